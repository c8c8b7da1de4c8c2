"""``create_app(config)``: the FastAPI application. The lifespan loads the model into an ``AsyncEngine``
(kept in ``app.state``), warms it up, and shuts it down gracefully."""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Sequence
from contextlib import asynccontextmanager
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, PlainTextResponse, Response
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware import Middleware

from ..engine.async_engine import AsyncEngine
from ..sampling_params import SamplingParams
from . import dialogue, native, openai_routes, openapi, voices_routes, websocket
from .auth import Authenticate, KeyRing
from .cache import ResultCache
from .config import ServerConfig, resolve_device
from .errors import APIError, ClientGone, ResponseCut
from .gc_freeze import frozen_start_up
from .limits import Limits, limited_routes, synthesis_routes
from .logs import REQUEST_ID
from .metrics import Metrics
from .openapi import error_response
from .timeouts import BodyReader
from .voices import VoiceStore, family_store_path
from .wyoming import WyomingServer

logger = logging.getLogger("chattts_serve.server")


async def _warm_up(eng: AsyncEngine) -> None:
    """One short request before the server says it is ready (kernels, allocator). ChatTTS's caps its tokens; another
    family's takes a seed only (ChatTTS's options are refused there by name) and a Latin text, which every VITS
    vocabulary can romanise; a checkpoint that cannot speak it is logged, not fatal (a warm-up is an optimisation)."""
    if eng.family.name == "chattts":
        text, params = "你好。", SamplingParams(seed=0, max_new_tokens=4, refine_text=False)
    else:
        text, params = "Hello.", SamplingParams(seed=0)
    try:
        await eng.generate(text, params)
    except ValueError as exc:
        logger.warning("warm-up skipped: the %s model cannot speak %r: %s", eng.family.name, text, exc)


def create_app(
    config: ServerConfig,
    engine: AsyncEngine | None = None,
    *,
    middleware: Sequence[Middleware] = (),
    keys: KeyRing | None = None,
) -> FastAPI:
    """The app. ``engine``: serve this one (else the lifespan loads ``config.model``). ``middleware``: ASGI
    middleware run inside the request context (after request ids, the Host and API key checks), the first
    outermost; Ray Serve replicas put their per-tenant limits there. ``keys``: the accepted keys with their
    tenants (default: ``config.api_keys``, no tenants)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        eng = engine
        if eng is None:
            if config.threads:
                import torch

                torch.set_num_threads(config.threads)
            eng = await asyncio.to_thread(
                AsyncEngine.from_pretrained,
                config.model,
                resolve_device(config.device),
                config.engine,
                max_buffered_audio_s=config.max_buffered_audio_s,
                family=config.family,
            )
        app.state.engine = eng
        app.state.loop = asyncio.get_running_loop()  # for the shutdown signal handler (run.py)
        app.state.metrics = Metrics(eng)
        app.state.voices = VoiceStore(family_store_path(config.voices.path, eng.family.name))
        app.state.limits = Limits(config.max_concurrent_streams)
        app.state.cache = ResultCache.for_engine(eng, config.cache_mb)
        if config.warmup:
            await _warm_up(eng)
        # Home Assistant's protocol, on the same engine, voices and limits as the HTTP API.
        wyoming = WyomingServer(app.state) if config.wyoming.uri is not None else None
        # The start-up heap (engine, graphs, warm-up) out of the collector's walks: a full collection over it
        # would stop every stream for ~0.2 s (gc_freeze.py).
        with frozen_start_up():
            try:
                if wyoming is not None:
                    await wyoming.start()
                app.state.ready = True
                logger.info(
                    "ready: model=%s family=%s sample_rate=%d device=%s slots=%d",
                    config.model,
                    eng.family.name,
                    eng.sample_rate,
                    eng.device,
                    eng.stats().kv_slots,
                )
                yield
            finally:
                app.state.ready = False
                if wyoming is not None:
                    await wyoming.stop()
                eng.shutdown()
                app.state.voices.close()

    app = FastAPI(title="chattts-serve", version="0.1.0", lifespan=lifespan)
    for extra in reversed(middleware):
        app.add_middleware(extra.cls, *extra.args, **extra.kwargs)
    app.add_middleware(BodyReader, max_bytes=config.max_body_bytes, timeout_s=config.timeouts.body_s)
    if keys is None:
        keys = KeyRing.from_keys(config.api_keys, config.api_keys_shared)
    app.add_middleware(Authenticate, keys=keys)
    app.add_middleware(RequestContext, config=config)
    app.state.config = config
    app.state.ready = False

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone):
        return Response(status_code=499)  # nobody reads it: the request was aborted when the client left

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return error_response(exc.status_code, str(exc.detail), exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:  # Starlette names only the first matching route's methods
            headers = {**(headers or {}), "Allow": ", ".join(_allowed_methods(request.app, request.scope))}
        return error_response(exc.status_code, str(exc.detail), headers=headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid" or "JSON" in msg:
            msg, loc = "request body is not valid JSON (UTF-8)", []
        return error_response(
            400, f"{'.'.join(loc) + ': ' if loc else ''}{msg}", param=".".join(loc) or None, code="invalid_request"
        )

    @app.get("/health", responses=openapi.errors())
    async def health(request: Request):
        # Liveness: fails only when the engine loop has died (an orchestrator should restart us);
        # loading the model at start-up is not a failure (that is /ready's business).
        eng = getattr(request.app.state, "engine", None)
        if eng is not None and eng.dead_error is not None:
            return error_response(
                503, "the engine loop has stopped; restart the server", "server_error", code="engine_dead"
            )
        return {"status": "ok"}

    @app.get("/ready", responses=openapi.errors())
    async def ready(request: Request):
        eng = getattr(request.app.state, "engine", None)
        if not request.app.state.ready or eng is None or eng.dead_error is not None:
            return error_response(503, "not ready", "server_error", code="not_ready")
        return {"status": "ready"}

    @app.get("/metrics", response_class=PlainTextResponse, responses=openapi.errors())
    async def metrics(request: Request):
        return PlainTextResponse(request.app.state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/", response_class=HTMLResponse)
    async def playground():
        return (resources.files("chattts_serve.server") / "static" / "index.html").read_text("utf-8")

    routers = (openai_routes.router, native.router, dialogue.router, websocket.router, voices_routes.router)
    for router in routers:
        app.include_router(router)
    app.state.synthesis_routes = synthesis_routes(route for router in routers for route in router.routes)
    app.state.limited_routes = limited_routes(route for router in routers for route in router.routes)
    openapi.install(app)
    return app


def _allowed_methods(app: FastAPI, scope) -> list[str]:
    """Every method some route serves at this path (for a 405's Allow header)."""
    from starlette.routing import Match

    methods: set[str] = set()
    for route in app.router.routes:
        match, _ = route.matches({**scope, "method": "GET"})
        route_methods = getattr(route, "methods", None)
        if match != Match.NONE and route_methods:
            methods |= route_methods
    return sorted(methods)


_REQUEST_ID = re.compile(r"[!-~]{1,128}")  # visible ASCII: no spaces, no line breaks


def _client_request_id(value: str | None) -> str | None:
    """A client's X-Request-ID if it is short and plain (it goes into logs and a response header)."""
    return value if value is not None and _REQUEST_ID.fullmatch(value) else None


class RequestContext:
    """ASGI middleware: request ids, the body-size header check, one log line per request (the Host and API
    key checks are ``auth.Authenticate``'s, just inside it). Pure ASGI (not ``BaseHTTPMiddleware``, which
    re-streams the body through a queue and would end a failed stream with a clean terminating chunk, as if
    it had succeeded)."""

    def __init__(self, app, config: ServerConfig) -> None:
        self.app, self.config = app, config

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request = Request(scope)
        # The engine gets an id of our own (two clients may send the same X-Request-ID); the client's
        # id, if it is a sane one, is kept for the logs and echoed back.
        rid = uuid.uuid4().hex[:16]
        client_rid = _client_request_id(request.headers.get("x-request-id"))
        scope.setdefault("state", {})["request_id"] = rid
        status, t0 = [0], time.monotonic()

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                MutableHeaders(scope=message)["X-Request-ID"] = client_rid or rid
            await send(message)

        refusal = self._refusal(request)
        token = REQUEST_ID.set(rid)  # JSON log lines of this request carry its id
        try:
            await (refusal or self.app)(scope, receive, send_with_id)
        except ResponseCut as exc:
            logger.warning("request_id=%s ended unfinished: %s", rid, exc)
        finally:
            logger.info(
                "request_id=%s client_request_id=%s method=%s path=%s status=%d ms=%.1f",
                rid,
                client_rid,
                request.method,
                request.url.path,  # never the query string: it may carry credentials
                status[0],
                1000 * (time.monotonic() - t0),
            )
            REQUEST_ID.reset(token)

    def _refusal(self, request: Request):
        limit = self.config.max_body_bytes
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > limit):
            return error_response(413, f"request body larger than {limit} bytes", code="too_large")
        return None
