"""``create_app(config)``: the FastAPI application. The lifespan loads the model into an ``AsyncEngine``
(kept in ``app.state``), warms it up, and shuts it down gracefully."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import asynccontextmanager
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.async_engine import AsyncEngine
from ..sampling_params import SamplingParams
from . import native, openai_routes, voices_routes
from .config import ServerConfig
from .metrics import Metrics
from .service import APIError, Limits
from .voices import VoiceStore

logger = logging.getLogger("chattts_serve.server")

PUBLIC_PATHS = ("/health", "/")  # the playground page is static HTML; it sends the key with its requests


def _error(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None, headers=None):
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _device(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def create_app(config: ServerConfig, engine: AsyncEngine | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        eng = engine
        if eng is None:
            if config.threads:
                import torch

                torch.set_num_threads(config.threads)
            eng = await asyncio.to_thread(
                AsyncEngine.from_pretrained, config.model, _device(config.device), config.engine
            )
        app.state.engine = eng
        app.state.metrics = Metrics(eng)
        app.state.voices = VoiceStore(config.voices_db)
        app.state.limits = Limits(config.max_concurrent_streams)
        if config.warmup:
            await eng.generate("你好。", SamplingParams(seed=0, max_new_tokens=4, refine_text=False))
        app.state.ready = True
        logger.info("ready: model=%s device=%s slots=%d", config.model, eng.device, eng.stats().kv_slots)
        try:
            yield
        finally:
            app.state.ready = False
            eng.shutdown()
            app.state.voices.close()

    app = FastAPI(title="chattts-serve", version="0.1.0", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    app.state.config = config
    app.state.ready = False

    @app.middleware("http")
    async def request_context(request: Request, call_next):
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex[:16]
        request.state.request_id = rid
        t0 = time.monotonic()
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > config.max_body_bytes):
            response = _error(413, f"request body larger than {config.max_body_bytes} bytes", code="too_large")
        elif config.api_keys and request.url.path not in PUBLIC_PATHS and not _authorized(request, config):
            response = _error(
                401,
                "missing or invalid API key (Authorization: Bearer <key>)",
                "authentication_error",
                code="invalid_api_key",
            )
        else:
            response = await call_next(request)
        response.headers["X-Request-ID"] = rid
        logger.info(
            "request_id=%s method=%s path=%s status=%d ms=%.1f",
            rid,
            request.method,
            request.url.path,
            response.status_code,
            1000 * (time.monotonic() - t0),
        )
        return response

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return _error(exc.status_code, str(exc.detail), exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid" or "JSON" in msg:
            msg, loc = "request body is not valid JSON (UTF-8)", []
        return _error(
            400, f"{'.'.join(loc) + ': ' if loc else ''}{msg}", param=".".join(loc) or None, code="invalid_request"
        )

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(request: Request):
        eng = getattr(request.app.state, "engine", None)
        if not request.app.state.ready or eng is None or eng.dead_error is not None:
            return _error(503, "not ready", "server_error", code="not_ready")
        return {"status": "ready"}

    @app.get("/metrics")
    async def metrics(request: Request):
        return Response(request.app.state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/", response_class=HTMLResponse)
    async def playground():
        return (resources.files("chattts_serve.server") / "static" / "index.html").read_text("utf-8")

    app.include_router(openai_routes.router)
    app.include_router(native.router)
    app.include_router(voices_routes.router)
    return app


def _authorized(request: Request, config: ServerConfig) -> bool:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip() in config.api_keys
    key = request.query_params.get("api_key")  # WebSocket clients (browsers) cannot set headers
    return key is not None and key in config.api_keys


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is answered 413, whether it announces its size
    (Content-Length) or arrives chunked. Bodies are small JSON, so a chunked one is buffered and replayed."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or any(k == b"content-length" for k, _ in scope["headers"]):
            return await self.app(scope, receive, send)
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, receive, send)  # disconnect: let the app see it
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                response = _error(413, f"request body larger than {self.max_bytes} bytes", code="too_large")
                return await response(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)
