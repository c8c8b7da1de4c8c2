"""Server configuration: ``ServerConfig`` = the server's own settings, grouped as ``EngineConfig`` groups
the engine's, + the ``EngineConfig`` it runs.

    ServerConfig
    ├── model, device, host, port, api_keys, connection and request limits, logging, ...
    ├── timeouts   TimeoutConfig     queue wait, send, header, body, shutdown
    ├── voices     VoiceConfig       the saved-voices database, its limits, the default voice
    ├── ws         WebSocketConfig   streaming-text session limits (WebSocket and Wyoming)
    ├── wyoming    WyomingConfig     the Wyoming listener (off by default)
    └── engine     EngineConfig      precision, KV slots, queue bound, decode step (``engine.config``)

Users set it through flat option names, one per leaf: the server's (``SERVER_OPTIONS``: ``port``,
``send_timeout_s``, ``ws_max_text_chars``, ...) and the engine's (``engine.config.FLAT_OPTIONS``:
``precision``, ``max_num_seqs``, ...). Each is a ``chattts-serve serve`` flag (``--send-timeout-s``), an
environment variable CHATTTS_SERVE_<NAME> (e.g. CHATTTS_SERVE_PORT=9000, CHATTTS_SERVE_API_KEYS=a,b,
CHATTTS_SERVE_PRECISION=int8-static) and a key of a Ray Serve config's ``server`` dict. Precedence:
flags, then environment, then the defaults.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar
from urllib.parse import urlsplit

from ..engine.config import FLAT_OPTIONS, EngineConfig
from ..engine.config import flat_defaults as engine_flat_defaults
from ..engine.config import from_flat as engine_from_flat
from ..models.chattts.config import DEFAULT_MODEL
from ..text.lexicon import load_lexicon
from .logs import LOG_FORMATS

ENV_PREFIX = "CHATTTS_SERVE_"

WYOMING_URI = "tcp://127.0.0.1:10200"
"""Where ``chattts-serve wyoming`` listens when no ``wyoming_uri`` is set."""


def _require(config: Any, *, at_least_one: tuple[str, ...] = (), positive: tuple[str, ...] = ()) -> None:
    """ValueError naming the flat option (the name the user set) of the first field out of range."""
    flat = getattr(config, "FLAT", {})
    for name in at_least_one:
        if getattr(config, name) < 1:
            raise ValueError(f"{flat.get(name, name)} must be >= 1, got {getattr(config, name)}")
    for name in positive:
        if not getattr(config, name) > 0:
            raise ValueError(f"{flat.get(name, name)} must be > 0, got {getattr(config, name)}")


@dataclass(frozen=True, slots=True)
class TimeoutConfig:
    """How long the server waits for a request's audio and for its clients."""

    FLAT: ClassVar[dict[str, str]] = {
        "queue_wait_s": "max_queue_wait_s",
        "send_s": "send_timeout_s",
        "header_s": "header_timeout_s",
        "body_s": "body_timeout_s",
        "shutdown_s": "shutdown_timeout_s",
    }

    queue_wait_s: float = 30.0
    """A request that has not produced audio after this long while queued is refused with 503."""
    send_s: float = 60.0
    """A client that accepts no bytes for this long is disconnected and its request aborted."""
    header_s: float = 10.0
    """A connection must send its request headers within this long (of opening, or of its previous
    response); else it is closed (slowloris)."""
    body_s: float = 30.0
    """A request body must arrive whole within this long; else 408 and the connection is closed."""
    shutdown_s: float = 10.0
    """On SIGTERM, requests in flight get this long to finish; a stream still running 2 s before the end
    ends as a failure its client can see (an SSE error event, a chunked body without its last chunk),
    never as a complete-looking file. (uvicorn closes WebSockets at once on shutdown, with 1012.)"""

    def __post_init__(self) -> None:
        _require(self, positive=tuple(self.FLAT))


@dataclass(frozen=True, slots=True)
class VoiceConfig:
    """Saved voices: where they are kept, how many, and what an upload may be."""

    FLAT: ClassVar[dict[str, str]] = {
        "db": "voices_db",
        "max_count": "max_voices",
        "max_text_chars": "max_voice_text_chars",
        "max_upload_seconds": "max_upload_seconds",
        "default": "default_voice",
    }

    db: str | None = None
    """SQLite file of saved voices (survives restarts); None: voices.sqlite3 in the user's data
    directory (platformdirs)."""
    max_count: int = 1000
    """Voices the database may hold."""
    max_text_chars: int = 500
    """Longest transcript of an uploaded voice sample."""
    max_upload_seconds: float = 30.0
    """Longest voice sample kept from an upload (decoding stops there)."""
    default: str | None = None
    """Voice used when a request names none that exists; None: no speaker embedding."""

    def __post_init__(self) -> None:
        _require(self, at_least_one=("max_count", "max_text_chars"), positive=("max_upload_seconds",))

    @property
    def path(self) -> str:
        """Where the voices database lives (``db``, or the user's data directory)."""
        if self.db is not None:
            return self.db
        import platformdirs

        directory = platformdirs.user_data_path("chattts-serve", appauthor=False, ensure_exists=True)
        return str(directory / "voices.sqlite3")


@dataclass(frozen=True, slots=True)
class WebSocketConfig:
    """Limits of one streaming-text session (a WebSocket; a Wyoming connection keeps the same ones)."""

    FLAT: ClassVar[dict[str, str]] = {
        "max_message_bytes": "ws_max_message_bytes",
        "max_text_chars": "ws_max_text_chars",
        "max_pending_sentences": "ws_max_pending_sentences",
        "idle_timeout_s": "ws_idle_timeout_s",
        "max_audio_seconds": "ws_max_audio_seconds",
    }

    max_message_bytes: int = 64 << 10
    """Largest WebSocket message."""
    max_text_chars: int = 100_000
    """Text one WebSocket session may send in all."""
    max_pending_sentences: int = 16
    """Sentences a WebSocket session may have waiting to be spoken; beyond it the server stops reading
    the socket until they are spoken (backpressure)."""
    idle_timeout_s: float = 300.0
    """A WebSocket session that sends nothing for this long (while nothing is being spoken) is closed."""
    max_audio_seconds: float = 3600.0
    """Audio one stream (a WebSocket stream, a Wyoming streamed synthesis) gives its client in all, counted as
    ``server.budget`` counts a request's (a slow-down stretch at its stretched length): each part is one engine
    request within ``max_audio_seconds``, and without this bound 100,000 characters of parts would buy
    50,000 of them."""

    def __post_init__(self) -> None:
        _require(
            self,
            at_least_one=("max_message_bytes", "max_text_chars", "max_pending_sentences"),
            positive=("idle_timeout_s", "max_audio_seconds"),
        )


@dataclass(frozen=True, slots=True)
class WyomingConfig:
    """The Wyoming protocol listener (Home Assistant), beside the HTTP API or alone (``chattts-serve
    wyoming``)."""

    FLAT: ClassVar[dict[str, str]] = {"uri": "wyoming_uri", "zeroconf": "wyoming_zeroconf"}

    uri: str | None = None
    """Also serve the Wyoming protocol here, e.g. tcp://0.0.0.0:10200; None: off."""
    zeroconf: str | None = None
    """Announce the Wyoming server on the local network (mDNS) under this name; None: off. Needs the
    ``zeroconf`` extra."""

    def __post_init__(self) -> None:
        if self.uri is not None:
            _check_wyoming_uri(self.uri)
        if self.zeroconf is not None and not (self.uri or "").startswith("tcp://"):
            raise ValueError("wyoming_zeroconf announces a TCP server: set wyoming_uri to tcp://HOST:PORT")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    model: str = DEFAULT_MODEL
    """Checkpoint directory or Hugging Face repo id."""
    family: str | None = None
    """The model family (``chattts``, ...: ``chattts_serve.models``); None: detected from the checkpoint's files
    or the repo id."""
    device: str = "auto"
    """auto (CUDA if available, else CPU; see ``resolve_device``), cpu, cuda, cuda:1, ..."""
    host: str = "127.0.0.1"
    """Where to listen. Beyond loopback without ``api_keys`` the server starts with a warning (anyone who can
    reach it can use it); it does not refuse to."""
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    """When set, every endpoint except /health needs ``Authorization: Bearer <key>``. Each key is its own
    principal: its own saved voices and result-cache entries (``server.auth``)."""
    api_keys_shared: bool = False
    """The ``api_keys`` are one principal: they share the saved voices (those of a server without keys) and
    the result cache, as one tenant's keys do."""
    max_concurrent_streams: int = 64
    """Requests in flight (running + waiting); beyond it requests get 429."""
    max_connections: int = 512
    """Open connections (HTTP and WebSocket); beyond it uvicorn answers 503 at once."""
    max_input_chars: int = 4096
    max_body_bytes: int = 1 << 20
    """Largest request body (JSON, or a multipart voice upload)."""
    max_buffered_audio_s: float = 120.0
    """Audio a request may have waiting for a client that stopped reading; beyond it the request is
    aborted (a stalled reader does not pin memory and a KV slot)."""
    allowed_origins: tuple[str, ...] = ()
    """Browser origins (``https://app.example``; ``*``: any) whose pages may use the server: an HTTP request
    or WebSocket handshake with another ``Origin`` header is refused (403). Empty: the server's own origin
    only (its playground page). Requests without ``Origin`` (clients that are not browsers) pass."""
    allowed_hosts: tuple[str, ...] = ()
    """Host names (no port; ``*``: any) a request or WebSocket handshake may name in its ``Host`` header,
    against DNS rebinding; others are refused (400). Empty: when the server listens on a loopback address
    (``host`` 127.0.0.1, ::1, localhost), only loopback names (localhost, 127.0.0.1, [::1], any port);
    elsewhere any. Behind a proxy that passes its own Host to a server on loopback, list that name."""
    default_options: str = ""
    """ChatTTS options (a JSON object, the fields of a ``/v1/tts`` body, e.g. ``{"refine_text": false, "seed":
    7}``) for every request that does not set them: the only way to tune clients that cannot send them
    (Home Assistant, Pipecat, LiveKit)."""
    lexicon: str | None = None
    """A pronunciation lexicon for every request (``text/lexicon.py``): a JSON object or ``word<TAB>value`` lines,
    word -> replacement text or pinyin with tone numbers (``chang2``); a request's ``lexicon`` entries win.
    Read once, at start-up."""
    cache_mb: int = 256
    """Result cache (``server/cache.py``): the audio of seeded requests, so that the same request again is
    answered without the engine, byte for byte; at most this many MiB, least recently used evicted first.
    0 turns it off."""
    warmup: bool = True
    log_level: str = "info"
    log_format: str = "text"
    """text (for people) or json (one JSON object per line, for log collectors)."""
    threads: int = 0
    """torch CPU threads; 0 = torch's default."""
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    voices: VoiceConfig = field(default_factory=VoiceConfig)
    ws: WebSocketConfig = field(default_factory=WebSocketConfig)
    wyoming: WyomingConfig = field(default_factory=WyomingConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Precision, KV slots, queue bound, decode step, default chunking (see ``engine.config``)."""

    def __post_init__(self) -> None:
        from .protocol import parse_options

        parse_options(self.default_options)  # a typo fails at start-up, not on the first request
        if self.family is not None:
            from .. import models

            models.get(self.family)  # an unknown family fails here, naming the known ones
        load_lexicon(self.lexicon)  # so does a bad lexicon entry
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        _require(
            self,
            at_least_one=("max_concurrent_streams", "max_connections", "max_input_chars", "max_body_bytes"),
            positive=("max_buffered_audio_s",),
        )
        if self.cache_mb < 0:
            raise ValueError(f"cache_mb must be >= 0 (0: no cache), got {self.cache_mb}")

    # ------------------------------------------------------------------ flat options

    @staticmethod
    def flat_defaults() -> dict[str, Any]:
        """Every flat option (server and engine) with its default: the flags', variables' and Ray
        ``server`` keys' names."""
        return ServerConfig().to_flat()

    def to_flat(self) -> dict[str, Any]:
        """This config as flat options (what ``from_flat`` reads back)."""
        out: dict[str, Any] = {}
        for name, path in SERVER_OPTIONS.items():
            value: Any = self
            for part in path:
                value = getattr(value, part)
            out[name] = value
        return out | engine_flat_defaults(self.engine)

    @classmethod
    def from_flat(cls, **options: Any) -> ServerConfig:
        """The defaults with the given flat options (server and engine) set; None values are skipped."""
        unknown = set(options) - set(SERVER_OPTIONS) - set(FLAT_OPTIONS)
        if unknown:
            raise ValueError(f"unknown server option(s): {', '.join(sorted(unknown))}")
        top: dict[str, Any] = {}
        sections: dict[str, dict[str, Any]] = {}
        for name, value in options.items():
            if value is None or name in FLAT_OPTIONS:
                continue
            path = SERVER_OPTIONS[name]
            if len(path) == 1:
                top[path[0]] = value
            else:
                sections.setdefault(path[0], {})[path[1]] = value
        top |= {name: _SECTIONS[name](**changes) for name, changes in sections.items()}
        engine = engine_from_flat(None, **{k: v for k, v in options.items() if k in FLAT_OPTIONS})
        return cls(**top, engine=engine)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> ServerConfig:
        """Defaults, then CHATTTS_SERVE_* environment variables, then explicit overrides (flat options;
        None values are skipped)."""
        environ = os.environ if environ is None else environ
        values = {}
        for name, default in cls.flat_defaults().items():
            raw = environ.get(ENV_PREFIX + name.upper())
            if raw is not None:
                values[name] = _parse(raw, default)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls.from_flat(**values)

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: dict[str, str] | None = None) -> ServerConfig:
        """From the flags ``add_server_arguments`` added (None: not given), over the environment."""
        return cls.from_env(environ, **{name: getattr(args, name, None) for name in cls.flat_defaults()})


_SECTIONS = {"timeouts": TimeoutConfig, "voices": VoiceConfig, "ws": WebSocketConfig, "wyoming": WyomingConfig}

SERVER_OPTIONS: dict[str, tuple[str, ...]] = {
    **{f.name: (f.name,) for f in fields(ServerConfig) if f.name not in _SECTIONS and f.name != "engine"},
    **{flat: (section, name) for section, kind in _SECTIONS.items() for name, flat in kind.FLAT.items()},
}
"""The server's flat option names -> the path of their field in ``ServerConfig``."""

assert {f.name for f in fields(ServerConfig) if f.name in _SECTIONS} == set(_SECTIONS)
assert all(set(kind.FLAT) == {f.name for f in fields(kind)} for kind in _SECTIONS.values())
assert not set(SERVER_OPTIONS) & set(FLAT_OPTIONS)


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per flat option, server and engine (defaults None: then CHATTTS_SERVE_* or the dataclass
    default; ``ServerConfig.from_args`` reads them)."""
    from ..engine.config import add_engine_arguments

    for name, default in ServerConfig().to_flat().items():
        if name in FLAT_OPTIONS:
            continue
        flag = "--" + name.replace("_", "-")
        doc = f"(default: {default!r}; env {ENV_PREFIX}{name.upper()})"
        if isinstance(default, bool):
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=doc)
        elif isinstance(default, tuple):
            p.add_argument(flag, dest=name, default=None, help="comma-separated " + doc, type=_comma_list)
        else:
            kind = type(default) if default is not None else str
            p.add_argument(flag, dest=name, type=kind, default=None, help=doc)
    add_engine_arguments(p, none_defaults=True)


def resolve_device(name: str) -> str:
    """``ServerConfig.device`` as a torch device name: "auto" is CUDA when available, else CPU."""
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_wyoming_uri(uri: str) -> None:
    """tcp://HOST:PORT or unix://PATH (the Wyoming library's stdio:// serves one client: not a server's)."""
    try:
        parts = urlsplit(uri)
        ok = (parts.scheme == "tcp" and parts.hostname and parts.port) or (parts.scheme == "unix" and parts.path)
    except ValueError:  # a port that is not a number
        ok = False
    if not ok:
        raise ValueError(f"wyoming_uri must be tcp://HOST:PORT or unix://PATH, got {uri!r}")


def _comma_list(value: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in value.split(",") if x.strip())


def _parse(raw: str, default: Any) -> Any:
    if isinstance(default, bool):
        return raw.strip().lower() in ("1", "true", "yes", "on")
    if isinstance(default, int):
        return int(raw)
    if isinstance(default, float):
        return float(raw)
    if isinstance(default, tuple):
        return _comma_list(raw)
    return raw
