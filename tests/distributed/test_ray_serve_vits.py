"""VITS on Ray Serve, for real: a local Ray cluster on 127.0.0.1 joined by ``chattts-serve ray serve`` with the tiny
random VITS checkpoint (detected from its files), one replica behind Serve's HTTP proxy. A replica is the same app as
``serve``, so VITS's own options (``noise_scale``, ``noise_scale_duration``) reach the model through the proxy, and
another family's option is a 400 naming it."""

from __future__ import annotations

import httpx
import pytest

from chattts_serve.models.vits.random_checkpoint import write_random

from .conftest import served_on_ray

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

QUIET = {"noise_scale": 0.0, "noise_scale_duration": 0.0}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray-vits")
    with served_on_ray(tmp, write_random(tmp / "vits", "tiny", seed=0)) as url:
        yield url


def pcm(base: str, **body) -> bytes:
    r = httpx.post(base + "/v1/tts", json={"text": "Hello there.", "format": "pcm", "stream": False, **body},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.content


def test_vitss_noise_options_reach_the_model_through_the_proxy(base):
    models = httpx.get(base + "/v1/models", timeout=60).json()["data"]
    assert {m["family"] for m in models} == {"vits"}
    assert pcm(base, seed=1) != pcm(base, seed=2)
    assert pcm(base, seed=1, **QUIET) == pcm(base, seed=2, **QUIET)  # no noise: the seed changes nothing
    r = httpx.post(base + "/v1/tts", json={"text": "Hello.", "noise_scale": 11}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "noise_scale"
    r = httpx.post(base + "/v1/tts", json={"text": "Hello.", "temperature": 0.3}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
