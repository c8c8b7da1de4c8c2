"""Saved voices on the app as a replica builds it, with two tenants, in this process: each tenant sees,
speaks with and deletes only its own voices (built-in names stay everyone's), each has its own voice cap,
and creating a voice is under the tenant's limits like synthesis."""

from __future__ import annotations

import httpx
import pytest

FIXED = {"seed": 1, "refine_text": False, "min_new_tokens": 4, "max_new_tokens": 4}


@pytest.fixture(scope="module")
def replica(tiny_ckpt, tmp_path_factory):
    from fastapi.testclient import TestClient

    from chattts_serve.distributed.settings import ServeSettings
    from chattts_serve.distributed.tenants import Tenant, TenantsConfig, replica_app_options
    from chattts_serve.server.app import create_app

    tenants = TenantsConfig(
        (
            Tenant("a", ("ka",)),
            Tenant("b", ("kb",)),
            Tenant("c", ("kc",), max_voices=1),  # its own cap, below the server's
            Tenant("small", ("ks",), max_concurrent=1, max_queued=0),
            Tenant("slow", ("kr",), rate_per_s=0.001, burst=1),
        )
    )
    db = tmp_path_factory.mktemp("tenant-voices") / "voices.sqlite3"
    server = {"model": str(tiny_ckpt), "device": "cpu", "voices_db": str(db), "warmup": False, "max_voices": 2}
    settings = ServeSettings(server=server, tenants=tenants)
    config = settings.server_config()
    app = create_app(config, **replica_app_options(settings.served_tenants, config.timeouts.queue_wait_s))
    with TestClient(app) as client:
        yield client


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _create(client, key: str, name: str, seed: int = 1) -> httpx.Response:
    return client.post("/v1/voices", json={"name": name, "seed": seed}, headers=_auth(key))


def _names(client, key: str) -> list[str]:
    r = client.get("/v1/voices", headers=_auth(key))
    assert r.status_code == 200, r.text
    return [v["name"] for v in r.json()["data"]]


def _speak(client, key: str, voice: str) -> httpx.Response:
    return client.post("/v1/tts", json={"text": "你好。", "format": "pcm", "voice": voice, **FIXED}, headers=_auth(key))


def _openai_speak(client, key: str, voice: str) -> httpx.Response:
    body = {"model": "tts-1", "input": "你好。", "voice": voice, "response_format": "pcm", **FIXED}
    return client.post("/v1/audio/speech", json=body, headers=_auth(key))


def _ws_start(client, key: str, voice: str) -> dict:
    with client.websocket_connect(f"/v1/tts/stream?api_key={key}") as ws:
        ws.send_json({"type": "start", "format": "pcm", "voice": voice, **FIXED})
        event = ws.receive_json()
        if event["type"] == "start":
            ws.send_json({"type": "end"})
        return event


def test_a_tenants_voice_is_invisible_to_another_tenant(replica):
    created = _create(replica, "kb", "b-voice")
    assert created.status_code == 201, created.text
    speaker = created.json()["speaker"]
    assert "b-voice" not in _names(replica, "ka")
    assert speaker not in replica.get("/v1/voices", headers=_auth("ka")).text
    assert replica.get("/v1/voices/b-voice", headers=_auth("ka")).status_code == 404
    for r in (_speak(replica, "ka", "b-voice"), _openai_speak(replica, "ka", "b-voice")):
        assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_voice", r.text
    event = _ws_start(replica, "ka", "b-voice")
    assert event["type"] == "error" and "unknown voice" in event["message"], event
    assert replica.delete("/v1/voices/b-voice", headers=_auth("ka")).status_code == 404
    # B still has it, and speaks with it
    assert _names(replica, "kb") == ["b-voice"]
    assert replica.get("/v1/voices/b-voice", headers=_auth("kb")).json()["speaker"] == speaker
    assert _speak(replica, "kb", "b-voice").status_code == 200
    assert _openai_speak(replica, "kb", "b-voice").status_code == 200
    assert _ws_start(replica, "kb", "b-voice")["type"] == "start"
    # A's voice of the same name is A's own; built-in names are everyone's
    assert _create(replica, "ka", "b-voice", seed=2).json()["speaker"] != speaker
    assert replica.get("/v1/voices/b-voice", headers=_auth("kb")).json()["speaker"] == speaker
    assert _speak(replica, "ka", "alloy").status_code == 200 and _speak(replica, "kb", "alloy").status_code == 200
    assert replica.delete("/v1/voices/b-voice", headers=_auth("ka")).status_code == 200
    assert _names(replica, "kb") == ["b-voice"] and _names(replica, "ka") == []
    assert replica.delete("/v1/voices/b-voice", headers=_auth("kb")).status_code == 200


def test_each_tenant_has_its_own_voice_cap(replica):
    for name in ("q1", "q2"):  # the server's max_voices (2) holds per tenant
        assert _create(replica, "ka", name).status_code == 201
    full = _create(replica, "ka", "q3")
    assert full.status_code == 409 and full.json()["error"]["code"] == "voice_limit_reached"
    assert "tenant 'a'" in full.json()["error"]["message"]
    for name in ("q1", "q2"):  # tenant a's voices take nothing from tenant b's room
        assert _create(replica, "kb", name).status_code == 201
    assert _create(replica, "kc", "c1").status_code == 201
    own = _create(replica, "kc", "c2")  # tenant c's own cap: 1
    assert own.status_code == 409 and "maximum of 1 voices" in own.json()["error"]["message"]
    for key, names in (("ka", ("q1", "q2")), ("kb", ("q1", "q2")), ("kc", ("c1",))):
        for name in names:
            assert replica.delete(f"/v1/voices/{name}", headers=_auth(key)).status_code == 200


def test_creating_a_voice_is_under_the_tenants_limits(replica):
    assert _create(replica, "kr", "r1").status_code == 201  # the bucket's one token
    flooded = _create(replica, "kr", "r2")
    assert flooded.status_code == 429 and flooded.json()["error"]["code"] == "tenant_rate_limited"
    assert "retry-after" in flooded.headers
    with replica.websocket_connect("/v1/tts/stream?api_key=ks") as held:
        held.send_json({"type": "start", "format": "pcm", **FIXED})
        assert held.receive_json()["type"] == "start"  # small's one slot is taken by a stream
        busy = _create(replica, "ks", "s1")
        assert busy.status_code == 429 and busy.json()["error"]["code"] == "tenant_capacity"
        assert _create(replica, "ka", "a-meanwhile").status_code == 201  # another tenant is served
        held.send_json({"type": "end"})
        assert held.receive_json()["type"] == "end"
    assert _create(replica, "ks", "s1").status_code == 201
    assert _names(replica, "ks") == ["s1"] and "a-meanwhile" in _names(replica, "ka")
