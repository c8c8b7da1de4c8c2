"""The playground page: served at ``/``, and (with Playwright + Debian's Chromium) driven in a real
headless browser: speak in several formats (live waveform, time to first audio, real-time factor,
download), saved voices (create from a seed or a recording, delete), the advanced options, API keys."""

from __future__ import annotations

import io
import os
import re
import shutil
import wave

import httpx
import numpy as np
import pytest

from chattts_serve import models
from chattts_serve.audio.wav import write_wav
from chattts_serve.models.vits.random_checkpoint import write_random as write_vits
from chattts_serve.sampling_params import speed_prompt

from .conftest import HTTP_TIMEOUT, SR, decode_audio, metric, running_server, start_server, wait_until

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
FINISHED = "['done', 'error', 'stopped'].includes(document.body.dataset.state)"

DURATION_JS = """() => new Promise((resolve) => {
  const a = document.getElementById('player');
  const done = () => { if (isFinite(a.duration) && a.duration > 0) resolve(a.duration); };
  a.addEventListener('loadedmetadata', done);
  a.addEventListener('durationchange', done);
  done();
  setTimeout(() => resolve(a.duration), 20000);
})"""

# Pixels of the waveform's colour (#2f6db5) on the canvas: what was drawn, not what was meant to be.
INK_JS = """() => {
  const c = document.getElementById('wave'), d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  let n = 0;
  for (let i = 0; i < d.length; i += 4) if (d[i] === 0x2f && d[i + 1] === 0x6d && d[i + 2] === 0xb5) n++;
  return n;
}"""


def test_page_is_served(server):
    r = httpx.get(server + "/", timeout=HTTP_TIMEOUT)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    html = r.text
    for element in (
        'id="text"',
        'id="format"',
        'id="seed"',
        'id="speak"',
        'id="player"',
        'id="wave"',
        'id="ttfa"',
        'id="rtf"',
        'id="download"',
        'id="voices"',
        '<details id="advanced"',
        'id="speed_mode"',
        "/v1/tts",
        "/v1/voices",
    ):
        assert element in html
    # Offline: nothing is loaded from another site (no CDN), every request goes to the page's own origin.
    assert not re.search(r"""(src|href|fetch\()\s*=?\s*["'](https?:)?//""", html), "external resource"


def _chromium():
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
def browser():
    sync_playwright = _chromium()
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=60_000)
        try:
            yield b
        finally:
            b.close()


class Page:
    """A fresh browser context on one server's playground, with the page errors it saw."""

    def __init__(self, browser, base: str) -> None:
        self.base = base
        self.context = browser.new_context(accept_downloads=True)
        self.pg = self.context.new_page()
        self.pg.set_default_timeout(60_000)
        self.errors: list[str] = []
        self.pg.on("pageerror", lambda exc: self.errors.append(str(exc)))
        self.pg.goto(base + "/", wait_until="load")

    def speak(self) -> tuple[dict, dict]:
        """Click Speak and wait for the request to finish: (request JSON body, request headers)."""
        pg = self.pg
        with pg.expect_request(lambda r: r.url.endswith("/v1/tts") and r.method == "POST") as info:
            pg.click("#speak")
        pg.wait_for_function(FINISHED, timeout=120_000)
        request = info.value
        return request.post_data_json, request.all_headers()

    def state(self) -> str:
        return self.pg.evaluate("document.body.dataset.state")


@pytest.fixture
def page(browser, server):
    p = Page(browser, server)
    try:
        yield p
    finally:
        p.context.close()


@pytest.fixture(scope="module")
def expected_pcm(server) -> bytes:
    """The same request the page makes (text, seed, stream, default parameters), made with httpx."""
    r = httpx.post(
        server + "/v1/tts", json={"text": TEXT, "format": "pcm", "stream": True, "seed": SEED}, timeout=HTTP_TIMEOUT
    )
    assert r.status_code == 200
    samples = len(r.content) // 2
    assert samples > 0 and (samples + 256) % 512 == 0
    return r.content


def _number(text: str) -> float:
    m = re.fullmatch(r"([0-9.]+)( ms| s)?", text.strip())
    assert m, text
    return float(m.group(1))


@pytest.mark.e2e
@pytest.mark.parametrize("fmt", ["pcm", "wav", "mp3"])
def test_speak_in_browser(page, expected_pcm, fmt):
    pg = page.pg
    samples = len(expected_pcm) // 2
    seconds = samples / SR
    pg.fill("#text", TEXT)
    pg.fill("#seed", str(SEED))
    pg.select_option("#format", fmt)
    body, _ = page.speak()
    assert body == {"text": TEXT, "format": fmt, "stream": True, "seed": SEED}  # no advanced option unless set
    status = pg.inner_text("#status")
    assert page.state() == "done", status
    assert status.startswith("done:"), status
    if fmt != "mp3":
        body_bytes = 2 * samples + (44 if fmt == "wav" else 0)
        assert f"done: {body_bytes} bytes" in status

    duration = pg.evaluate(DURATION_JS)
    assert duration == pytest.approx(seconds, abs=0.05 if fmt != "mp3" else 0.15), (fmt, duration, seconds, status)

    # The waveform: drawn from the PCM while it streamed (pcm, wav), from the decoded file (mp3).
    wave_data = pg.eval_on_selector("#wave", "c => ({...c.dataset})")
    assert pg.evaluate(INK_JS) > 100, wave_data
    if fmt == "mp3":
        assert int(wave_data["liveDraws"]) == 0 and int(wave_data["samples"]) >= samples
    else:
        assert int(wave_data["samples"]) == samples
        assert int(wave_data["liveDraws"]) >= 2, wave_data  # drawn again as audio arrived ...
        assert int(wave_data["firstLiveBytes"]) < body_bytes, wave_data  # ... starting before the end

    # Time to first audio and real-time factor: shown, and in the history row of this request.
    ttfa, audio_s, rtf = (_number(pg.inner_text(f"#{i}")) for i in ("ttfa", "audio-seconds", "rtf"))
    assert ttfa > 0 and rtf > 0
    assert audio_s == pytest.approx(seconds, abs=0.01 if fmt != "mp3" else 0.15)
    row = pg.eval_on_selector_all("#history tbody tr:first-child td", "tds => tds.map(td => td.textContent)")
    assert row[:3] == ["1", fmt, str(len(TEXT))], row
    total_s = float(row[5])
    assert float(row[6]) == pytest.approx(total_s / audio_s, rel=0.02, abs=0.002)
    assert float(row[3]) == pytest.approx(ttfa, abs=1) and ttfa / 1000 <= total_s

    # The download button saves the audio.
    with pg.expect_download() as info:
        pg.click("#download")
    data = open(info.value.path(), "rb").read()  # noqa: SIM115 - read once
    if fmt == "mp3":
        assert info.value.suggested_filename.endswith(".mp3")
        audio, rate = decode_audio(data, "mp3")
        assert rate == SR and len(audio) / SR == pytest.approx(seconds, abs=0.15)
    else:  # a wav file with its real sizes (the streamed header's are open-ended)
        assert info.value.suggested_filename.endswith(".wav")
        with wave.open(io.BytesIO(data)) as w:
            assert (w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()) == (SR, 1, 2, samples)
            assert w.readframes(samples) == expected_pcm  # the same audio as the API gives (fp32, one request)
    assert not page.errors, page.errors


def _voice(server: str, name: str) -> httpx.Response:
    return httpx.get(f"{server}/v1/voices/{name}", timeout=HTTP_TIMEOUT)


@pytest.mark.e2e
def test_voice_from_seed_then_delete(page, server):
    pg, name = page.pg, "pg-seed-voice"
    pg.fill("#voice-name", name)
    pg.fill("#voice-seed", "42")
    pg.click("#voice-create")
    item = pg.wait_for_selector(f'#voices li[data-name="{name}"]')
    assert _voice(server, name).json()["kind"] == "speaker"
    assert pg.eval_on_selector("#voice", "s => s.value") == name  # ready to speak with
    # Delete asks first: dismissed, nothing happens; accepted, the voice is gone.
    pg.once("dialog", lambda d: d.dismiss())
    item.query_selector("button.delete").click()
    pg.wait_for_timeout(300)
    assert _voice(server, name).status_code == 200
    pg.once("dialog", lambda d: d.accept())
    item.query_selector("button.delete").click()
    pg.wait_for_selector(f'#voices li[data-name="{name}"]', state="detached")
    assert _voice(server, name).status_code == 404
    assert name not in pg.eval_on_selector_all("#voice option", "os => os.map(o => o.value)")
    assert not page.errors, page.errors


@pytest.mark.e2e
def test_voice_from_recording(page, server, tmp_path):
    pg, name, transcript = page.pg, "pg-recording", "你好，这是一段测试录音。"
    path = tmp_path / "sample.wav"
    t = np.arange(SR) / SR
    write_wav(path, 0.3 * np.sin(2 * np.pi * 220 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t)), 24000)
    pg.set_input_files("#voice-file", str(path))
    pg.fill("#voice-name", name)
    pg.fill("#voice-text", transcript)
    pg.click("#voice-create")
    item = pg.wait_for_selector(f'#voices li[data-name="{name}"]', timeout=120_000)
    assert transcript in item.inner_text()
    voice = _voice(server, name).json()
    assert voice["kind"] == "sample" and voice["sample_text"] == transcript
    assert httpx.delete(f"{server}/v1/voices/{name}", timeout=HTTP_TIMEOUT).status_code == 200
    assert not page.errors, page.errors


@pytest.mark.e2e
def test_bad_voice_name_shows_the_error(page, server):
    pg = page.pg
    pg.fill("#voice-name", "no spaces allowed")
    pg.fill("#voice-seed", "1")
    pg.click("#voice-create")
    pg.wait_for_function("document.getElementById('voice-status').textContent.startsWith('create failed')")
    assert "400" in pg.inner_text("#voice-status")


@pytest.mark.e2e
def test_advanced_options_change_the_request(page):
    pg = page.pg
    pg.fill("#text", TEXT)
    pg.fill("#seed", str(SEED))
    assert not pg.is_visible("#temperature")  # folded away until asked for
    pg.click("#advanced summary")
    pg.fill("#temperature", "0.5")
    pg.fill("#top_p", "0.8")
    pg.fill("#top_k", "10")
    pg.select_option("#speed", "3")
    pg.uncheck("#refine")
    pg.fill("#refine_prompt", "[oral_2][laugh_0][break_4]")
    body, _ = page.speak()
    assert body == {
        "text": TEXT,
        "format": "pcm",
        "stream": True,
        "seed": SEED,
        "temperature": 0.5,
        "top_p": 0.8,
        "top_k": 10,
        "prompt": "[speed_3]",
        "refine_text": False,
        "refine_prompt": "[oral_2][laugh_0][break_4]",
    }
    assert page.state() == "done", pg.inner_text("#status")  # the server took every option
    # An out-of-range option is the server's 400, shown on the page.
    pg.fill("#top_p", "2")
    page.speak()
    assert page.state() == "error"
    assert "400" in pg.inner_text("#status") and "top_p" in pg.inner_text("#status")
    assert not page.errors, page.errors


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["stretch", "both"])
def test_speed_mode_sends_the_rate_of_the_speed_token(page, expected_pcm, mode):
    """Speed N with a speed mode other than "prompt" is OpenAI's speed for the rate [speed_N] stands for
    (the server's speed_prompt, inverted); "stretch" is the default-speed audio time-stretched to it."""
    pg = page.pg
    pg.fill("#text", TEXT)
    pg.fill("#seed", str(SEED))
    pg.click("#advanced summary")
    pg.select_option("#speed", "3")
    pg.select_option("#speed_mode", mode)
    body, _ = page.speak()
    factor = 2 ** ((3 - 5) / 2.5)
    assert body == {"text": TEXT, "format": "pcm", "stream": True, "seed": SEED, "speed": factor, "speed_mode": mode}
    assert speed_prompt(body["speed"]) == "[speed_3]"  # what "both" prompts for
    assert page.state() == "done", pg.inner_text("#status")
    if mode == "stretch":  # the same tokens, stretched: exactly as long as the stretch makes it
        samples = round(len(expected_pcm) // 2 / factor)
        assert _number(pg.inner_text("#audio-seconds")) == pytest.approx(samples / SR, abs=0.01)
    assert not page.errors, page.errors


@pytest.mark.e2e
def test_stop_aborts_the_request(page, server):
    pg = page.pg
    aborted = metric(server, "chattts_aborted_requests_total")
    pg.fill("#text", TEXT)
    pg.click("#speak")
    assert wait_until(lambda: metric(server, "chattts_requests_in_flight") >= 1, timeout=30)
    assert page.state() == "busy" and pg.is_enabled("#stop")
    pg.click("#stop")
    pg.wait_for_function(FINISHED)
    assert page.state() == "stopped" and pg.inner_text("#status").startswith("stopped")
    # The server saw the client leave: the request was aborted, and nothing is left in flight.
    assert wait_until(lambda: metric(server, "chattts_aborted_requests_total") > aborted, timeout=30)
    assert wait_until(lambda: metric(server, "chattts_requests_in_flight") == 0, timeout=30)
    assert pg.is_enabled("#speak") and not pg.is_enabled("#stop")
    assert not page.errors, page.errors


@pytest.mark.e2e
def test_api_key(browser, tiny_ckpt, tmp_path):
    key = "playground-key-1"
    with start_server(tiny_ckpt, tmp_path, "--api-keys", key, "--max-num-seqs", "2", "--no-warmup") as srv:
        page = Page(browser, srv.base)  # the page itself needs no key ...
        try:
            pg = page.pg
            pg.wait_for_function("document.getElementById('voices-note').textContent.includes('API key')")
            pg.fill("#text", TEXT)
            pg.click("#advanced summary")
            pg.uncheck("#refine")
            _, headers = page.speak()  # ... its requests do
            assert page.state() == "error" and "401" in pg.inner_text("#status")
            assert "authorization" not in headers
            pg.fill("#key", key)
            pg.dispatch_event("#key", "change")
            pg.wait_for_function("document.getElementById('voices-note').textContent === 'no saved voices yet'")
            _, headers = page.speak()
            assert page.state() == "done", pg.inner_text("#status")
            assert headers["authorization"] == f"Bearer {key}"
            assert not page.errors, page.errors
        finally:
            page.context.close()
        log = srv.log()
    assert key not in log


# ------------------------------------------------------------------------------------- other families
# The page is the same for every family: it asks /v1/models what the served family reads and offers that.


@pytest.fixture(scope="module")
def kokoro_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("playground-kokoro")
    root = models.get("kokoro").write_random(tmp / "kokoro", "tiny")
    with running_server(root, tmp, "--max-num-seqs", "4", in_process=True) as base:
        yield base


@pytest.fixture(scope="module")
def vits_server(tmp_path_factory):
    """A 3-speaker checkpoint: its speakers are the built-in voices."""
    tmp = tmp_path_factory.mktemp("playground-vits")
    root = write_vits(tmp / "vits", "tiny", seed=1, num_speakers=3, speaker_embedding_size=8)
    with running_server(root, tmp, "--max-num-seqs", "4", in_process=True) as base:
        yield base


def _card(base: str) -> dict:
    r = httpx.get(base + "/v1/models", timeout=HTTP_TIMEOUT)
    assert r.status_code == 200
    return r.json()["data"][0]


# Per family: its options as /v1/models lists them, a value for each that the server takes, and a voice.
FAMILY_OPTIONS = {
    "kokoro": {"speed": 1.5, "lang_code": "z", "phonemes": "ni↓xau↓"},
    "vits": {"speed": 0.8, "noise_scale": 0.3, "noise_scale_duration": 0.5},
    "chattts": {"temperature": 0.5, "top_p": 0.8, "top_k": 10, "refine_text": False, "refine_prompt": "[oral_2]"},
}


@pytest.mark.parametrize("family", ["kokoro", "vits", "chattts"])
def test_models_lists_the_familys_voices_options_and_sample_text(request, family):
    base = request.getfixturevalue({"kokoro": "kokoro_server", "vits": "vits_server", "chattts": "server"}[family])
    card = _card(base)
    assert card["family"] == family
    options = {o["name"]: o for o in card["options"]}
    assert list(options) == list(FAMILY_OPTIONS[family])
    # Only this family's own options and common ones: never one another family owns.
    owners = models.option_owners()
    assert all(owners.get(name, family) == family for name in options), options
    assert card["sample_text"] == models.get(family).sample_text
    voices = [v["name"] for v in card["voices"]]
    if family == "vits":
        assert voices == ["speaker_0", "speaker_1", "speaker_2"]
        assert options["noise_scale"]["default"] is None and options["noise_scale"]["maximum"] == 10.0
    if family == "kokoro":
        assert {"af_heart", "zf_xiaobei"} <= set(voices)
        assert options["lang_code"]["kind"] == "choice" and "z" in options["lang_code"]["choices"]
    # Every option listed, at a value in its range, is one the server takes.
    text = "hello world" if family == "vits" else "你好。"
    body = {"text": text, "format": "pcm", "seed": 1, **FAMILY_OPTIONS[family]}
    if family == "chattts":
        body.update(min_new_tokens=8, max_new_tokens=8)
    else:
        body["voice"] = voices[-1]
    for name, value in FAMILY_OPTIONS[family].items():
        spec = options[name]
        if spec["kind"] in ("number", "integer"):
            assert spec["minimum"] <= value <= spec["maximum"], (name, spec)
    r = httpx.post(base + "/v1/tts", json=body, timeout=HTTP_TIMEOUT)
    assert r.status_code == 200, r.text


FAMILY_FORM = {  # what a person types in each family's option form, and the voice they pick
    "kokoro": ({"opt-speed": "1.5", "opt-lang_code": "z"}, "zf_xiaobei", "你好，世界。"),
    "vits": (
        {"opt-speed": "0.8", "opt-noise_scale": "0.3", "opt-noise_scale_duration": "0"},
        "speaker_2",
        "hello world",
    ),
}


@pytest.mark.e2e
@pytest.mark.parametrize("family", ["kokoro", "vits"])
def test_the_page_offers_the_served_familys_voices_and_options(request, browser, family):
    base = request.getfixturevalue(f"{family}_server")
    page = Page(browser, base)
    try:
        pg = page.pg
        pg.wait_for_function(f"document.body.dataset.family === '{family}'")
        # ChatTTS's block is gone, the family's form is there instead, with its sample text.
        assert not pg.is_visible("#advanced") and pg.is_visible("#options")
        assert pg.input_value("#text") == models.get(family).sample_text
        fields = pg.eval_on_selector_all("#option-fields [id^=opt-]", "es => es.map(e => e.id)")
        assert fields == [f"opt-{name}" for name in FAMILY_OPTIONS[family]]
        builtin = pg.eval_on_selector_all("#voices-builtin option", "os => os.map(o => o.value)")
        assert builtin == [v["name"] for v in _card(base)["voices"]]

        form, voice, text = FAMILY_FORM[family]
        pg.fill("#text", text)
        pg.fill("#seed", str(SEED))
        pg.select_option("#voice", voice)
        pg.click("#options summary")
        for field, value in form.items():
            if pg.eval_on_selector(f"#{field}", "e => e.tagName") == "SELECT":
                pg.select_option(f"#{field}", value)
            else:
                pg.fill(f"#{field}", value)
        body, _ = page.speak()
        options = {f.removeprefix("opt-"): float(v) if v[0].isdigit() else v for f, v in form.items()}
        assert body == {"text": text, "format": "pcm", "stream": True, "voice": voice, "seed": SEED, **options}
        assert page.state() == "done", pg.inner_text("#status")
        assert int(pg.eval_on_selector("#wave", "c => c.dataset.samples")) > 0

        # Word timings: the same request through the captioned route, each word in the table.
        captioned = httpx.post(
            base + "/v1/tts/captioned", json={**body, "stream": False, "format": "wav"}, timeout=HTTP_TIMEOUT
        )
        assert captioned.status_code == 200, captioned.text
        expected = [
            [w["word"], f"{w['start_time']:.3f}", f"{w['end_time']:.3f}"]
            for s in captioned.json()["segments"]
            for w in s["words"]
        ]
        assert expected
        with pg.expect_response(lambda r: r.url.endswith("/v1/tts/captioned")):
            pg.click("#words-button")
        pg.wait_for_function("!document.getElementById('words').hidden")
        rows = pg.eval_on_selector_all(
            "#words tbody tr", "trs => trs.map(tr => [...tr.cells].map(td => td.textContent))"
        )
        assert rows == expected

        # A blend of built-in voices replaces the voice chosen; a bad option value is the server's 400.
        first, second = builtin[0], builtin[-1]
        pg.fill("#blend", f"{first}(2)+{second}(1)")
        body, _ = page.speak()
        assert body["voice"] == f"{first}(2)+{second}(1)" and page.state() == "done", pg.inner_text("#status")
        pg.fill("#opt-speed", "9")
        page.speak()
        assert page.state() == "error" and "400" in pg.inner_text("#status") and "speed" in pg.inner_text("#status")
        assert not page.errors, page.errors
    finally:
        page.context.close()


@pytest.mark.e2e
def test_chattts_keeps_its_own_block(page):
    pg = page.pg
    pg.wait_for_function("document.body.dataset.family === 'chattts'")
    assert pg.is_visible("#advanced") and not pg.is_visible("#options")
    assert not pg.is_visible("#words-button")  # ChatTTS times sentences, not words
    assert pg.input_value("#text") == models.get("chattts").sample_text
    builtin = pg.eval_on_selector_all("#voices-builtin option", "os => os.map(o => o.value)")
    assert builtin == [v["name"] for v in _card(page.base)["voices"]]
