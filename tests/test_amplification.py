"""``scripts/amplification.py``: the bounds follow from the limits, and a live tiny server (max_audio_seconds
10) keeps every route's worst request within them."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "amplification.py"


def _load():
    spec = importlib.util.spec_from_file_location("amplification", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def test_bounds_follow_the_limits():
    from chattts_serve.server.config import ServerConfig

    rows = {r.route: r for r in _load().bounds(600.0, ServerConfig())}
    assert rows["/v1/tts"].audio_s == 600 and rows["/v1/tts"].steps == 28125
    assert rows["/v1/tts"].bytes == 2 * 48000 * 600 + 44  # wav at the highest rate
    assert rows["/v1/dialogue"].audio_s == 600  # the turns and pauses share it
    assert rows["WebSocket"].audio_s == 3600  # the stream's parts share ws_max_audio_seconds
    assert rows["WebSocket"].steps == 3600 * 46.875 and rows["WebSocket"].bytes == 2 * 48000 * 3600


@pytest.mark.integration
def test_every_route_stays_within_its_bounds(tiny_ckpt):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--model", str(tiny_ckpt)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc = json.loads(out.stdout)
    assert doc["over"] == [] and doc["max_audio_seconds"] == 10
    measured = {r["route"]: r["measured"] for r in doc["routes"]}
    assert set(measured) == {r["route"] for r in doc["routes"]}  # every route was measured
    for route, m in measured.items():
        assert m["audio_s"] > 0, route
        if route != "WebSocket":  # (three parts of 10 s each)
            assert m["audio_s"] <= 10.05, (route, m)
