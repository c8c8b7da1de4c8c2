"""server/limits.py without a server: the in-flight bound and its 429."""

from __future__ import annotations

import pytest

from chattts_serve.server.errors import APIError
from chattts_serve.server.limits import Limits


def test_beyond_the_bound_is_a_429_with_retry_after_until_a_release():
    limits = Limits(2)
    limits.acquire()
    limits.acquire()
    with pytest.raises(APIError) as exc:
        limits.acquire()
    assert exc.value.status_code == 429 and exc.value.code == "capacity"
    assert exc.value.headers == {"Retry-After": "1"}
    assert limits.in_flight == 2  # a refused request holds nothing
    limits.release()
    limits.acquire()
    assert limits.in_flight == 2


def test_synthesis_routes_are_found_by_their_tag_inside_a_route_prefix():
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route, WebSocketRoute

    from chattts_serve.server.limits import is_synthesis, synthesis, synthesis_routes

    @synthesis
    async def tts(request):
        return Response()

    async def voices(request):
        return Response()

    routes = [
        Route("/v1/tts", tts, methods=["POST"]),
        Route("/v1/voices", voices),
        WebSocketRoute("/v1/tts/stream", tts),
    ]
    app = Starlette(routes=routes)
    app.state.synthesis_routes = synthesis_routes(app.routes)

    def synthesises(kind: str, path: str, root_path: str = "", method: str = "POST") -> bool:
        return is_synthesis({"type": kind, "path": path, "root_path": root_path, "method": method, "app": app})

    assert synthesises("http", "/v1/tts")
    assert not synthesises("http", "/v1/tts", method="GET")  # a 405, not synthesis
    assert synthesises("http", "/tenants/vip/v1/tts", "/tenants/vip")  # Serve's route prefix
    assert synthesises("websocket", "/t/v1/tts/stream", "/t")
    assert not synthesises("http", "/tenants/vip/v1/voices", "/tenants/vip", "GET")
    assert not synthesises("http", "/tenants/vip/v1/tts")  # prefix not stripped: another app


def test_the_apps_synthesis_routes_are_speech_tts_dialogue_and_the_websocket():
    from chattts_serve.server.app import create_app
    from chattts_serve.server.config import ServerConfig

    app = create_app(ServerConfig.from_flat(warmup=False))
    assert app.state.synthesis_routes == {
        ("http", "POST", "/v1/audio/speech"),
        ("http", "POST", "/v1/tts"),
        ("http", "POST", "/v1/tts/captioned"),
        ("http", "POST", "/v1/dialogue"),
        ("websocket", "", "/v1/tts/stream"),
    }


def test_limited_routes_are_synthesis_and_voice_creation():
    from chattts_serve.server.app import create_app
    from chattts_serve.server.config import ServerConfig

    app = create_app(ServerConfig.from_flat(warmup=False))
    assert app.state.limited_routes == {*app.state.synthesis_routes, ("http", "POST", "/v1/voices")}
