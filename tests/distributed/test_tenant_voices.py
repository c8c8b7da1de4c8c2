"""Saved voices on the app as a replica builds it, with tenants, in this process: creating a voice is under
the tenant's limits like synthesis."""

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
            Tenant("small", ("ks",), max_concurrent=1, max_queued=0),
            Tenant("slow", ("kr",), rate_per_s=0.001, burst=1),
        )
    )
    db = tmp_path_factory.mktemp("tenant-voices") / "voices.sqlite3"
    server = {"model": str(tiny_ckpt), "device": "cpu", "voices_db": str(db), "warmup": False}
    settings = ServeSettings(server=server, tenants=tenants)
    config = settings.server_config()
    app = create_app(config, **replica_app_options(settings.served_tenants, config.timeouts.queue_wait_s))
    with TestClient(app) as client:
        yield client


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _create(client, key: str, name: str, seed: int = 1) -> httpx.Response:
    return client.post("/v1/voices", json={"name": name, "seed": seed}, headers=_auth(key))


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
