"""Running the server as a process: ``run_server`` (uvicorn: HTTP, WebSocket and, when configured, Wyoming)
and ``run_wyoming`` (the Wyoming server alone). Both configure the process's logging, block until a signal
and return the exit code.

What uvicorn does not do on its own, and how it is added here:

* a graceful shutdown that clients can see: on the first SIGTERM/SIGINT ``/ready`` answers 503 (balancers
  stop routing here), and streams still running shortly before the grace period ends are ended by the
  engine as visible failures, instead of being cancelled mid-write (``handle_exit`` wrapped);
* a start-up banner printed once the model is warm and the socket is bound, with the address it really
  listens on (``startup`` wrapped);
* a header deadline (``timeouts.protocol_with_header_timeout``) and secrets masked in every log record;
* a warning when it listens beyond loopback without API keys (``auth.open_to_anyone``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import logging
import signal
from dataclasses import replace

from .config import WYOMING_URI, ServerConfig

logger = logging.getLogger("chattts_serve.server")


def run_server(config: ServerConfig) -> int:
    """Serve ``config`` under uvicorn until SIGTERM/SIGINT; 0 after a clean shutdown."""
    with contextlib.suppress(io.UnsupportedOperation, AttributeError, ValueError):  # stderr without a file
        # A crash in native code (torch, ONNX Runtime, PyAV) then leaves every thread's Python stack in the
        # log instead of a server that is simply gone.
        faulthandler.enable()
    import uvicorn

    from .app import create_app
    from .auth import KeyRing, open_to_anyone

    _configure_logging(config)
    if warning := open_to_anyone(config.host, KeyRing.from_keys(config.api_keys)):
        logger.warning(warning)  # a warning, not a refusal: images and clusters that bind 0.0.0.0 still start
    # uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown; a no-op handler lets a clean
    # shutdown end with exit code 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    app = create_app(config)
    server = uvicorn.Server(uvicorn_config(config, app))
    exit_handler = server.handle_exit

    def handle_exit(sig, frame) -> None:
        if app.state.ready:  # the first signal
            app.state.ready = False  # /ready answers 503 from now on: balancers stop routing here
            _end_streams_before_the_deadline(app, config.timeouts.shutdown_s)
        exit_handler(sig, frame)

    server.handle_exit = handle_exit
    _banner_on_start(server, app, config)
    server.run()
    return 0


def uvicorn_config(config: ServerConfig, app):
    """uvicorn's settings for serving ``app`` as ``config`` says (tests serve in-process with the same), and
    its loggers' secret masking (uvicorn configures its loggers when the settings are made)."""
    import uvicorn

    from .logs import install_log_redaction
    from .timeouts import protocol_with_header_timeout

    settings = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        # JSON: uvicorn's loggers get no handlers of their own and reach the root's JSON one.
        log_config=None if config.log_format == "json" else uvicorn.config.LOGGING_CONFIG,
        timeout_graceful_shutdown=config.timeouts.shutdown_s,
        # Our middleware logs every request without its query string (which may carry a key).
        access_log=False,
        # Connections beyond this get 503 at once (slowloris and floods stay bounded).
        limit_concurrency=config.max_connections,
        timeout_keep_alive=5,
        http=protocol_with_header_timeout(config.timeouts.header_s),  # uvicorn has no header deadline
        # Twice the app's own limit: a message just over it still gets the app's error event; far
        # over it, uvicorn refuses it (1009) before buffering it whole.
        ws_max_size=2 * config.ws.max_message_bytes,
    )
    install_log_redaction()
    return settings


def run_wyoming(config: ServerConfig) -> int:
    """The Wyoming server alone (at ``WYOMING_URI`` unless configured): the app's start-up (engine,
    warm-up, voices, limits) without uvicorn, until SIGTERM/SIGINT."""
    import asyncio

    from .app import create_app

    if config.wyoming.uri is None:
        config = replace(config, wyoming=replace(config.wyoming, uri=WYOMING_URI))
    _configure_logging(config)
    app = create_app(config)

    async def run() -> None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        async with app.router.lifespan_context(app):
            print(f"chattts-serve wyoming: {config.wyoming.uri} (model {config.model})", flush=True)
            await stop.wait()

    asyncio.run(run())
    return 0


def _end_streams_before_the_deadline(app, grace_s: float) -> None:
    """Streams still running shortly before uvicorn's grace period ends are ended by the engine, so they
    fail the way their clients can see (``AudioResponse``: an error event, an unfinished chunked body)
    rather than being cancelled mid-write when uvicorn gives up on them."""
    loop, engine = getattr(app.state, "loop", None), getattr(app.state, "engine", None)
    if loop is None or engine is None:
        return

    def end_all() -> None:
        if ended := engine.end_all("the server is shutting down"):
            logger.warning("shutdown: ended %d unfinished request(s)", ended)

    delay = grace_s - min(2.0, grace_s / 2)  # time left for the error events to go out
    loop.call_soon_threadsafe(loop.call_later, delay, end_all)


def _configure_logging(config: ServerConfig) -> None:
    """The root handler (the CLI's ``basicConfig``) gets the level, the format (text or JSON lines) and
    the secret redaction: a filter on a handler sees every record that propagates to it, from any logger."""
    from .logs import JsonFormatter, RedactSecrets

    root = logging.getLogger()
    root.setLevel(config.log_level.upper())
    for handler in root.handlers:
        handler.addFilter(RedactSecrets())
        if config.log_format == "json":
            handler.setFormatter(JsonFormatter())


def _banner_on_start(server, app, config: ServerConfig) -> None:
    """Print where the server listens and what it runs, on stdout, once the model is loaded and warmed up
    and the socket is bound (after uvicorn's startup: the address is the one it really listens on)."""
    from .logs import Banner, listen_url

    startup = server.startup

    async def startup_then_banner(sockets=None) -> None:
        await startup(sockets=sockets)
        if not server.started:
            return
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        url = listen_url(config.host or host, port)
        engine = app.state.engine
        banner = Banner(
            url=url,
            playground=url + "/",
            model=config.model,
            device=str(engine.device),
            precision=config.engine.precision,
            slots=engine.stats().kv_slots,
            auth=bool(config.api_keys),
        )
        print(banner.json() if config.log_format == "json" else banner.text(), flush=True)

    server.startup = startup_then_banner
