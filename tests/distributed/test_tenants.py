"""Tenant limits without Ray: the config, the token bucket, the gate (rate, concurrency, FIFO queue, queue
wait), the ASGI middleware on a small app (429 with Retry-After, another tenant still served), and two tenants
on the app as a replica builds it, in this process, against every key trick."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from chattts_serve.distributed.tenants import (
    MAX_RETRY_AFTER_S,
    MIN_RATE_PER_S,
    Tenant,
    TenantGate,
    TenantLimited,
    TenantLimits,
    TenantsConfig,
    TokenBucket,
    _refuse,
)
from chattts_serve.server.auth import Authenticate
from chattts_serve.server.config import ServerConfig
from chattts_serve.server.limits import limited_routes, synthesis, synthesis_routes


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
    ring = config.key_ring()
    assert ring.owner("a2") == (True, "acme")
    assert ring.owner("v") == (True, "vip")
    assert ring.owner("nope") == (False, None)
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


def test_a_vanishing_rate_is_refused_and_retry_after_stays_finite():
    with pytest.raises(ValueError, match="rate_per_s must be 0"):
        Tenant("t", ("k",), rate_per_s=1e-320)  # was accepted, and its refusal path raised OverflowError (500)
    assert Tenant("t", ("k",), rate_per_s=MIN_RATE_PER_S).bucket_size == 1
    # Whatever wait a limit computes, the refusal is a 429 whose Retry-After is a whole number of seconds.
    for wait, expected in ((float("inf"), MAX_RETRY_AFTER_S), (1e300, MAX_RETRY_AFTER_S), (0.2, 1), (2.5, 3)):
        sent: list[dict] = []

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict, sent=sent) -> None:
            sent.append(message)

        exc = TenantLimited("t", "rate", "over its rate", wait)
        asyncio.run(_refuse({"type": "http", "method": "POST", "path": "/v1/tts", "headers": []}, receive, send, exc))
        assert sent[0]["status"] == 429
        assert dict(sent[0]["headers"])[b"retry-after"] == str(expected).encode()


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


def _limited(app: Starlette, config: TenantsConfig, max_wait_s: float = 5, keys=None) -> Starlette:
    """``app`` behind the tenant limits and ``server.auth`` (which names each request's tenant), as
    ``create_app`` stacks them; ``keys``: other keys for ``auth`` than the tenants'."""
    app.state.config = ServerConfig()
    app.state.synthesis_routes = synthesis_routes(app.routes)
    app.state.limited_routes = limited_routes(app.routes)
    app.add_middleware(TenantLimits, config=config, max_wait_s=max_wait_s)
    app.add_middleware(Authenticate, keys=config.key_ring() if keys is None else keys)
    return app


def _app(config: TenantsConfig, release: asyncio.Event) -> Starlette:
    @synthesis
    async def speech(request):
        await release.wait()
        return JSONResponse({"tenant": request.scope["state"].get("tenant")})

    async def voices(request):
        return JSONResponse({"ok": True})

    return _limited(
        Starlette(routes=[Route("/v1/audio/speech", speech, methods=["POST"]), Route("/v1/voices", voices)]), config
    )


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

    config = TenantsConfig((Tenant("t", ("k",), rate_per_s=0.001, burst=1),))
    app = _limited(Starlette(routes=[WebSocketRoute("/v1/tts/stream", stream)]), config, max_wait_s=1)
    with TestClient(app) as client:
        with client.websocket_connect("/v1/tts/stream?api_key=k") as ws:
            assert ws.receive_json() == {"type": "end"}
        with client.websocket_connect("/v1/tts/stream?api_key=k") as ws:  # the bucket is empty now
            event = ws.receive_json()
            assert event["type"] == "error" and event["code"] == "tenant_rate_limited" and event["fatal"]
            closed = ws.receive()
            assert closed["type"] == "websocket.close" and closed["code"] == 1013


def test_a_key_of_no_tenant_is_refused_not_served_unlimited():
    """Should ``auth`` ever let in a key of no tenant (an app built with other keys), the limits refuse it."""
    from starlette.routing import WebSocketRoute
    from starlette.testclient import TestClient

    from chattts_serve.server.auth import KeyRing

    @synthesis
    async def speech(request):
        return JSONResponse({"tenant": request.scope["state"].get("tenant")})

    @synthesis
    async def stream(ws):
        await ws.accept()
        await ws.close()

    config = TenantsConfig((Tenant("t", ("k",), max_concurrent=1),))
    routes = [Route("/v1/audio/speech", speech, methods=["POST"]), WebSocketRoute("/v1/tts/stream", stream)]
    app = _limited(Starlette(routes=routes), config, keys=KeyRing((("k", "t"), ("other", None))))
    with TestClient(app) as client:
        assert client.post("/v1/audio/speech", headers={"Authorization": "Bearer k"}).json() == {"tenant": "t"}
        r = client.post("/v1/audio/speech", headers={"Authorization": "Bearer other"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with client.websocket_connect("/v1/tts/stream?api_key=other") as ws:
            assert ws.receive_json()["code"] == "invalid_api_key"
            assert ws.receive()["code"] == 1008


# ------------------------------------------------------------------ two tenants on the replica's app, in process
# The app as ``ChatTTSReplica`` builds it (``replica_app_options``), driven by TestClient: tenant "small" has two
# keys and room for one stream, no queue; "big" has room for four; "vip" has its own application (not this one).

FIXED = {"seed": 1, "refine_text": False, "min_new_tokens": 4, "max_new_tokens": 4}
TTS = {"text": "你好。", "format": "pcm", **FIXED}
BASIC = ("Authorization", "Basic eDp5")


@pytest.fixture(scope="module")
def replica(tiny_ckpt, tmp_path_factory):
    from fastapi.testclient import TestClient

    from chattts_serve.distributed.settings import ServeSettings
    from chattts_serve.distributed.tenants import replica_app_options
    from chattts_serve.server.app import create_app

    tenants = TenantsConfig(
        (
            Tenant("small", ("s1", "s2"), max_concurrent=1, max_queued=0),
            Tenant("big", ("b1",), max_concurrent=4),
            Tenant("vip", ("v1",), dedicated={"num_replicas": 1}),
        )
    )
    db = tmp_path_factory.mktemp("tenants-inproc") / "voices.sqlite3"
    server = {"model": str(tiny_ckpt), "device": "cpu", "voices_db": str(db), "warmup": False}
    settings = ServeSettings(server=server, tenants=tenants)
    config = settings.server_config()
    app = create_app(config, **replica_app_options(settings.served_tenants, config.timeouts.queue_wait_s))
    with TestClient(app) as client:
        yield client


def _tts(client, key: str | None = None, headers=(), query: str = ""):
    headers = [*headers, ("Authorization", f"Bearer {key}")] if key else list(headers)
    return client.post("/v1/tts?" + query, json=TTS, headers=httpx.Headers(headers))


def _ws_first_event(client, query: str, headers=()) -> tuple[dict, int | None]:
    """Open a session, send its start; (the first event, the close code if the server closed right after)."""
    with client.websocket_connect("/v1/tts/stream?" + query, headers=httpx.Headers(list(headers))) as ws:
        ws.send_json({"type": "start", "format": "pcm", **FIXED})
        event = ws.receive_json()
        if event["type"] != "error":
            ws.send_json({"type": "end"})
            return event, None
        return event, ws.receive()["code"]


def test_only_the_served_tenants_keys_are_accepted(replica):
    assert len(_tts(replica, "s2").content) > 0
    assert _tts(replica, "b1").status_code == 200
    for key in ("v1", "junk", None):  # vip is another application's tenant
        r = _tts(replica, key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        event, code = _ws_first_event(replica, f"api_key={key}" if key else "")
        assert (event["code"], code) == ("invalid_api_key", 1008)


# (headers, query, the refusal's code) of POST /v1/tts while tenant small's one stream is taken
HTTP_TRICKS = [
    ([], "", "invalid_api_key"),
    ([("Authorization", "Bearer s1")], "", "tenant_capacity"),
    ([("Authorization", "Bearer s2")], "", "tenant_capacity"),  # the tenant's other key
    ([("Authorization", "Bearer s2")], "api_key=s2", "tenant_capacity"),
    ([], "api_key=s2", "invalid_api_key"),
    ([("Authorization", "Bearer junk")], "api_key=s2", "invalid_api_key"),
    ([BASIC, ("Authorization", "Bearer junk")], "api_key=s2", "invalid_api_key"),
    ([("Authorization", "Bearer s1"), ("Authorization", "Bearer b1")], "", "invalid_api_key"),
    ([("Authorization", "Bearer s2")], "api_key=junk&api_key=s2", "invalid_api_key"),
    ([("Authorization", "Bearer s2")], "api_key=b1", "invalid_api_key"),
    ([BASIC], "api_key=s2", "invalid_api_key"),
]
# (query, headers, the refusal's code) of a WebSocket session meanwhile
WS_TRICKS = [
    ("", [], "invalid_api_key"),
    ("api_key=s1", [], "tenant_capacity"),
    ("api_key=s2", [], "tenant_capacity"),
    ("", [("Authorization", "Bearer s2")], "tenant_capacity"),
    ("api_key=s2", [BASIC], "tenant_capacity"),
    ("api_key=junk&api_key=s2", [], "invalid_api_key"),
    ("api_key=s2&api_key=junk", [], "invalid_api_key"),
    ("api_key=junk&api_k%65y=s2", [], "invalid_api_key"),
    ("api_key=s2", [BASIC, ("Authorization", "Bearer junk")], "invalid_api_key"),
    ("api_key=s2", [("Authorization", "Bearer junk")], "invalid_api_key"),
    ("api_key=s2", [("Authorization", "Bearer b1")], "invalid_api_key"),
    ("api_key=b1", [("Authorization", "Bearer s2")], "invalid_api_key"),
]
CLOSE = {"invalid_api_key": 1008, "tenant_capacity": 1013}


def test_a_tenant_at_its_cap_gets_no_second_stream_by_any_key_trick(replica):
    with replica.websocket_connect("/v1/tts/stream?api_key=s1") as held:
        held.send_json({"type": "start", "format": "pcm", **FIXED})
        assert held.receive_json()["type"] == "start"  # small's one stream is open (and idle)
        for headers, query, code in HTTP_TRICKS:
            r = _tts(replica, headers=headers, query=query)
            assert r.status_code == (429 if code == "tenant_capacity" else 401), (headers, query, r.text)
            assert r.json()["error"]["code"] == code
        for query, headers, code in WS_TRICKS:
            event, closed = _ws_first_event(replica, query, headers)
            assert (event["type"], event["code"], closed) == ("error", code, CLOSE[code]), (query, headers, event)
        assert _tts(replica, "b1").status_code == 200  # the other tenant is served meanwhile
        held.send_json({"type": "end"})
        assert held.receive_json()["type"] == "end"
    assert _tts(replica, "s2").status_code == 200  # the stream is over: the slot is free again


def test_the_replica_app_caps_bodies_and_websocket_messages_itself(replica):
    """Serve's proxy is plain uvicorn with none of ``serve``'s size limits (``ws_max_size``): the replica's own
    ASGI layer refuses a body past ``max_body_bytes`` (streamed, no Content-Length) and a WebSocket message
    past ``ws_max_message_bytes``."""
    config = ServerConfig()

    def chunks():
        for _ in range(config.max_body_bytes // 4096 + 1):
            yield b" " * 4096

    r = replica.post("/v1/tts", content=chunks(), headers={"Authorization": "Bearer b1", "Content-Type": "text/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large", r.text
    with replica.websocket_connect("/v1/tts/stream?api_key=b1") as ws:
        ws.send_text(json.dumps({"type": "start", "format": "pcm", "text": "x" * config.ws.max_message_bytes}))
        event = ws.receive_json()
        assert (event["type"], event["code"]) == ("error", "message_too_big"), event
        assert ws.receive()["code"] == 1009
