"""Kokoro-82M on Ray Serve, for real: a local Ray cluster on 127.0.0.1 joined by ``chattts-serve ray serve`` with
the tiny random Kokoro checkpoint (detected from its files), one replica behind Serve's HTTP proxy. A replica is
the same app as ``serve``: Kokoro's voices, blends, ``speed`` and ``phonemes`` reach the model through the proxy,
word timestamps come back, and another family's option is a 400 naming it."""

from __future__ import annotations

import httpx
import pytest

from chattts_serve import models

from .conftest import served_on_ray

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

pytest.importorskip("misaki")  # Kokoro's text front-end (the [kokoro] extra)

TEXT = "你好，世界。"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray-kokoro")
    with served_on_ray(tmp, models.get("kokoro").write_random(tmp / "kokoro", "tiny")) as url:
        yield url


def tts(base: str, **body) -> httpx.Response:
    return httpx.post(base + "/v1/tts", json={"format": "pcm", "stream": False, **body}, timeout=120)


def test_kokoros_voices_speed_and_phonemes_reach_the_model_through_the_proxy(base):
    models_ = httpx.get(base + "/v1/models", timeout=60).json()["data"]
    assert {m["family"] for m in models_} == {"kokoro"}
    plain = tts(base, text=TEXT, voice="zf_xiaobei", seed=1)
    assert plain.status_code == 200, plain.text
    assert tts(base, text=TEXT, voice="zf_xiaobei", seed=1).content == plain.content  # seeded: the same audio
    fast = tts(base, text=TEXT, voice="zf_xiaobei", seed=1, speed=2.0)
    assert fast.status_code == 200 and len(fast.content) < len(plain.content)  # Kokoro's own speed: shorter
    blend = tts(base, text=TEXT, voice="af_bella(2)+af_sky(1)", lang_code="z", seed=1)
    assert blend.status_code == 200, blend.text
    said = tts(base, text="-", phonemes="həlˈO", voice="af_bella", seed=1)
    assert said.status_code == 200 and len(said.content) > 0, said.text


def test_word_timestamps_and_another_familys_option_through_the_proxy(base):
    r = httpx.post(base + "/v1/tts/captioned", json={"text": TEXT, "voice": "zf_xiaobei", "seed": 1}, timeout=120)
    assert r.status_code == 200, r.text
    assert any(seg.get("words") for seg in r.json()["segments"])
    r = tts(base, text=TEXT, voice="zf_xiaobei", noise_scale=0.5)
    assert r.status_code == 400 and r.json()["error"]["param"] == "noise_scale"
