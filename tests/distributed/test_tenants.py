"""Tenant limits without Ray: the config, the token bucket, the gate (rate, concurrency, FIFO queue, queue
wait) and the ASGI middleware on a small app (429 with Retry-After, another tenant still served)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from chattts_serve.distributed.tenants import (
    Tenant,
    TenantGate,
    TenantLimited,
    TenantLimits,
    TenantsConfig,
    TokenBucket,
    request_key,
)
from chattts_serve.server.limits import synthesis, synthesis_routes


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_config_round_trip_and_key_lookup(tmp_path):
    data = {
        "tenants": [
            {"name": "acme", "api_keys": ["a1", "a2"], "max_concurrent": 2, "max_queued": 1, "rate_per_s": 0.5},
            {"name": "vip", "api_keys": ["v"], "dedicated": {"num_replicas": 2}},
        ]
    }
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(data))
    config = TenantsConfig.load(path)
    assert config.tenant_for("a2").name == "acme"
    assert config.tenant_for("v").name == "vip"
    assert config.tenant_for("nope") is None
    assert config.api_keys == ("a1", "a2", "v")
    assert TenantsConfig.from_dict(config.to_dict()) == config
    assert config.tenants[0].bucket_size == 1  # ceil(0.5), at least 1


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"tenants": [{"name": "a b", "api_keys": ["k"]}]}, "tenant name"),
        ({"tenants": [{"name": "a", "api_keys": []}]}, "at least one"),
        ({"tenants": [{"name": "a", "api_keys": "k"}]}, "list of strings"),
        ({"tenants": [{"name": "a", "api_keys": ["k"], "max_concurrent": -1}]}, "max_concurrent"),
        ({"tenants": [{"name": "a", "api_keys": ["k"], "rate_per_s": float("nan")}]}, "rate_per_s"),
        ({"tenants": [{"name": "a", "api_keys": ["k"], "colour": "red"}]}, "unknown field"),
        ({"tenants": [{"name": "a", "api_keys": ["k"]}, {"name": "a", "api_keys": ["j"]}]}, "unique"),
        ({"tenants": [{"name": "a", "api_keys": ["k"]}, {"name": "b", "api_keys": ["k"]}]}, "more than one"),
        ({"tenants": [{"name": "a", "api_keys": ["k"], "dedicated": {"gpus": 1}}]}, "dedicated"),
        ({"tenant": []}, "tenants config"),
    ],
)
def test_bad_configs_are_clear_errors(data, match):
    with pytest.raises(ValueError, match=match):
        TenantsConfig.from_dict(data)


def test_unreadable_file_is_a_value_error(tmp_path):
    bad = tmp_path / "t.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read the tenants file"):
        TenantsConfig.load(bad)


def test_token_bucket_refills_at_its_rate():
    clock = Clock()
    bucket = TokenBucket(rate=2.0, size=2, clock=clock)
    assert bucket.take() == 0 and bucket.take() == 0
    assert bucket.take() == pytest.approx(0.5)  # one token every 0.5 s
    clock.now += 0.5
    assert bucket.take() == 0
    clock.now += 10  # never more than the bucket holds
    assert [bucket.take() for _ in range(3)][:2] == [0, 0]


def test_gate_rate_limit():
    clock = Clock()
    gate = TenantGate(Tenant("t", ("k",), rate_per_s=1.0, burst=1), max_wait_s=1, clock=clock)

    async def run():
        await gate.acquire()
        gate.release()
        with pytest.raises(TenantLimited) as err:
            await gate.acquire()
        assert err.value.reason == "rate" and err.value.retry_after_s == pytest.approx(1.0)
        clock.now += 1.0
        await gate.acquire()

    asyncio.run(run())


def test_gate_concurrency_queue_fifo_and_caps():
    gate = TenantGate(Tenant("t", ("k",), max_concurrent=1, max_queued=2), max_wait_s=5)
    order = []

    async def request(name: str, hold: asyncio.Event):
        await gate.acquire()
        order.append(name)
        await hold.wait()
        gate.release()

    async def run():
        holds = {n: asyncio.Event() for n in "abc"}
        tasks = [asyncio.create_task(request(n, holds[n])) for n in "abc"]
        await asyncio.sleep(0.01)
        assert order == ["a"] and gate.in_flight == 1 and gate.num_queued == 2
        with pytest.raises(TenantLimited) as err:  # queue full: refused at once
            await gate.acquire()
        assert err.value.reason == "concurrency"
        holds["a"].set()
        await asyncio.sleep(0.01)
        assert order == ["a", "b"] and gate.in_flight == 1 and gate.num_queued == 1  # the slot passed on
        holds["b"].set()
        holds["c"].set()
        await asyncio.gather(*tasks)
        assert order == ["a", "b", "c"] and gate.in_flight == 0 and gate.num_queued == 0

    asyncio.run(run())


def test_gate_queue_wait_times_out_and_cancelled_waiters_leave():
    gate = TenantGate(Tenant("t", ("k",), max_concurrent=1, max_queued=5), max_wait_s=0.05)

    async def run():
        await gate.acquire()
        with pytest.raises(TenantLimited) as err:
            await gate.acquire()
        assert err.value.reason == "queue_wait" and gate.num_queued == 0
        waiter = asyncio.create_task(gate.acquire())
        await asyncio.sleep(0.01)
        waiter.cancel()  # a client gone while queued
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert gate.num_queued == 0
        gate.release()
        assert gate.in_flight == 0
        await gate.acquire()  # the slot is free again, not handed to the cancelled waiter
        assert gate.in_flight == 1

    asyncio.run(run())


def test_request_key_header_and_websocket_query():
    assert request_key({"type": "http", "headers": [(b"authorization", b"Bearer abc")]}) == "abc"
    assert request_key({"type": "http", "headers": [], "query_string": b"api_key=abc"}) is None
    assert request_key({"type": "websocket", "headers": [], "query_string": b"api_key=abc"}) == "abc"


def _app(config: TenantsConfig, release: asyncio.Event) -> Starlette:
    @synthesis
    async def speech(request):
        await release.wait()
        return JSONResponse({"tenant": request.scope["state"].get("tenant")})

    async def voices(request):
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/v1/audio/speech", speech, methods=["POST"]), Route("/v1/voices", voices)])
    app.state.synthesis_routes = synthesis_routes(app.routes)
    app.add_middleware(TenantLimits, config=config, max_wait_s=5)
    return app


def test_middleware_answers_429_to_the_tenant_over_its_cap_only():
    config = TenantsConfig((Tenant("small", ("ks",), max_concurrent=1), Tenant("big", ("kb",), max_concurrent=4)))

    async def run():
        release = asyncio.Event()
        app = _app(config, release)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:

            def post(key):
                return client.post("/v1/audio/speech", headers={"Authorization": f"Bearer {key}"}, json={})

            first = asyncio.create_task(post("ks"))
            await asyncio.sleep(0.05)
            refused = await post("ks")
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == "1"
            err = refused.json()["error"]
            assert err["type"] == "rate_limit_error" and err["code"] == "tenant_capacity"
            other = asyncio.create_task(post("kb"))
            unlimited = await client.get("/v1/voices", headers={"Authorization": "Bearer ks"})
            assert unlimited.status_code == 200  # only synthesis is limited
            release.set()
            assert (await first).json() == {"tenant": "small"}
            assert (await other).json() == {"tenant": "big"}
            assert (await post("ks")).status_code == 200  # the slot was given back

    asyncio.run(run())


def test_a_websocket_over_its_tenant_limit_gets_an_error_event_and_1013():
    from starlette.routing import WebSocketRoute
    from starlette.testclient import TestClient
    from starlette.websockets import WebSocket

    @synthesis
    async def stream(ws: WebSocket):
        await ws.accept()
        await ws.send_json({"type": "end"})
        await ws.close()

    app = Starlette(routes=[WebSocketRoute("/v1/tts/stream", stream)])
    app.state.synthesis_routes = synthesis_routes(app.routes)
    config = TenantsConfig((Tenant("t", ("k",), rate_per_s=0.001, burst=1),))
    app.add_middleware(TenantLimits, config=config, max_wait_s=1)
    with TestClient(app) as client:
        with client.websocket_connect("/v1/tts/stream?api_key=k") as ws:
            assert ws.receive_json() == {"type": "end"}
        with client.websocket_connect("/v1/tts/stream?api_key=k") as ws:  # the bucket is empty now
            event = ws.receive_json()
            assert event["type"] == "error" and event["code"] == "tenant_rate_limited" and event["fatal"]
            closed = ws.receive()
            assert closed["type"] == "websocket.close" and closed["code"] == 1013
