"""The playground page: served at ``/``, and (with Playwright + Debian's Chromium) driven in a real
headless browser: type, pick a format, Speak, and check the <audio> element's duration."""

from __future__ import annotations

import os
import shutil

import httpx
import pytest

from .conftest import HTTP_TIMEOUT, SR

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--autoplay-policy=no-user-gesture-required",
]
TEXT = "今天天气真不错。"
SEED = 1

DURATION_JS = """() => new Promise((resolve) => {
  const a = document.getElementById('player');
  const done = () => { if (isFinite(a.duration) && a.duration > 0) resolve(a.duration); };
  a.addEventListener('loadedmetadata', done);
  a.addEventListener('durationchange', done);
  done();
  setTimeout(() => resolve(a.duration), 20000);
})"""


def test_page_is_served(server):
    r = httpx.get(server + "/", timeout=HTTP_TIMEOUT)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    html = r.text
    for element in ('id="text"', 'id="format"', 'id="seed"', 'id="speak"', 'id="player"', "/v1/tts"):
        assert element in html


def _browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright (Python) is not installed")
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        pytest.skip(
            f"{CHROMIUM} not found (install Debian's 'chromium' package); which chromium: {shutil.which('chromium')}"
        )
    return sync_playwright


@pytest.fixture(scope="module")
def page(server):
    sync_playwright = _browser()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=60_000)
        try:
            context = browser.new_context()
            pg = context.new_page()
            pg.set_default_timeout(60_000)
            yield pg
        finally:
            browser.close()


@pytest.fixture(scope="module")
def expected_seconds(server) -> float:
    """The same request the page makes (text, seed, stream, default parameters), made with httpx."""
    r = httpx.post(
        server + "/v1/tts", json={"text": TEXT, "format": "pcm", "stream": True, "seed": SEED}, timeout=HTTP_TIMEOUT
    )
    assert r.status_code == 200
    samples = len(r.content) // 2
    assert samples > 0 and (samples + 256) % 512 == 0
    return samples / SR


@pytest.mark.parametrize("fmt", ["pcm", "wav"])
def test_speak_in_browser(server, page, expected_seconds, fmt):
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(server + "/", wait_until="load")
    page.fill("#text", TEXT)
    page.fill("#seed", str(SEED))
    page.select_option("#format", fmt)
    assert page.evaluate("document.body.dataset.done") is None
    page.click("#speak")
    page.wait_for_function("document.body.dataset.done === '1'", timeout=60_000)
    status = page.inner_text("#status")
    assert status.startswith("done:"), status
    duration = page.evaluate(DURATION_JS)
    assert duration == pytest.approx(expected_seconds, abs=0.05), (fmt, duration, expected_seconds, status)
    samples = round(expected_seconds * SR)
    body_bytes = 2 * samples + (44 if fmt == "wav" else 0)
    assert f"done: {body_bytes} bytes" in status
    assert not errors, errors
