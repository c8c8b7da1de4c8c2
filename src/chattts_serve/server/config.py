"""Server configuration: ``ServerConfig`` = the server's own settings + the ``EngineConfig`` it runs.

``chattts-serve serve`` has one flag per server field and per flat engine option (``engine.config
.FLAT_OPTIONS``: precision, max_num_seqs, decode, ...); each can also be set from the environment as
CHATTTS_SERVE_<NAME> (e.g. CHATTTS_SERVE_PORT=9000, CHATTTS_SERVE_API_KEYS=a,b,
CHATTTS_SERVE_PRECISION=int8-static). Precedence: flags, then environment, then the defaults.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any
from urllib.parse import urlsplit

from ..engine.config import FLAT_OPTIONS, EngineConfig, flat_defaults, from_flat
from ..model.config import DEFAULT_MODEL
from .logs import LOG_FORMATS

ENV_PREFIX = "CHATTTS_SERVE_"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    model: str = DEFAULT_MODEL
    """Checkpoint directory or Hugging Face repo id."""
    device: str = "auto"
    """auto (CUDA if available, else CPU), cpu, cuda, cuda:1, ..."""
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    """When set, every endpoint except /health needs ``Authorization: Bearer <key>``."""
    max_concurrent_streams: int = 64
    """Requests in flight (running + waiting); beyond it requests get 429."""
    max_connections: int = 512
    """Open connections (HTTP and WebSocket); beyond it uvicorn answers 503 at once."""
    max_queue_wait_s: float = 30.0
    """A request that has not produced audio after this long while queued is refused with 503."""
    max_input_chars: int = 4096
    max_body_bytes: int = 1 << 20
    """Largest request body (JSON, or a multipart voice upload)."""
    max_buffered_audio_s: float = 120.0
    """Audio a request may have waiting for a client that stopped reading; beyond it the request is
    aborted (a stalled reader does not pin memory and a KV slot)."""
    send_timeout_s: float = 60.0
    """A client that accepts no bytes for this long is disconnected and its request aborted."""
    header_timeout_s: float = 10.0
    """A connection must send its request headers within this long (of opening, or of its previous
    response); else it is closed (slowloris)."""
    body_timeout_s: float = 30.0
    """A request body must arrive whole within this long; else 408 and the connection is closed."""
    shutdown_timeout_s: float = 10.0
    """On SIGTERM, requests in flight get this long to finish; a stream still running 2 s before the end
    ends as a failure its client can see (an SSE error event, a chunked body without its last chunk),
    never as a complete-looking file. (uvicorn closes WebSockets at once on shutdown, with 1012.)"""
    voices_db: str | None = None
    """SQLite file of saved voices (survives restarts); None: voices.sqlite3 in the user's data
    directory (platformdirs)."""
    max_voices: int = 1000
    max_voice_text_chars: int = 500
    """Longest transcript of an uploaded voice sample."""
    max_upload_seconds: float = 30.0
    """Longest voice sample kept from an upload (decoding stops there)."""
    default_voice: str | None = None
    """Voice used when a request names none that exists; None: no speaker embedding."""
    ws_max_message_bytes: int = 64 << 10
    """Largest WebSocket message."""
    ws_max_text_chars: int = 100_000
    """Text one WebSocket session may send in all."""
    ws_max_pending_sentences: int = 16
    """Sentences a WebSocket session may have waiting to be spoken; beyond it the server stops reading
    the socket until they are spoken (backpressure)."""
    ws_idle_timeout_s: float = 300.0
    """A WebSocket session that sends nothing for this long (while nothing is being spoken) is closed."""
    allowed_origins: tuple[str, ...] = ()
    """Browser origins allowed to open WebSockets (and to POST with a browser); empty: same origin only."""
    allowed_hosts: tuple[str, ...] = ()
    """Host headers accepted (DNS-rebinding defence); empty: any."""
    default_options: str = ""
    """ChatTTS options (a JSON object, the fields of a ``/v1/tts`` body, e.g. ``{"refine_text": false, "seed":
    7}``) for every request that does not set them: the only way to tune clients that cannot send them
    (Home Assistant, Pipecat, LiveKit)."""
    wyoming_uri: str | None = None
    """Also serve the Wyoming protocol (Home Assistant) here, e.g. tcp://0.0.0.0:10200; None: off."""
    wyoming_zeroconf: str | None = None
    """Announce the Wyoming server on the local network (mDNS) under this name; None: off. Needs the
    ``zeroconf`` extra."""
    warmup: bool = True
    log_level: str = "info"
    log_format: str = "text"
    """text (for people) or json (one JSON object per line, for log collectors)."""
    threads: int = 0
    """torch CPU threads; 0 = torch's default."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Precision, KV slots, queue bound, decode step, default chunking (see ``engine.config``)."""

    def __post_init__(self) -> None:
        from .protocol import parse_options

        parse_options(self.default_options)  # a typo fails at start-up, not on the first request
        if self.wyoming_uri is not None:
            _check_wyoming_uri(self.wyoming_uri)
        if self.wyoming_zeroconf is not None and not (self.wyoming_uri or "").startswith("tcp://"):
            raise ValueError("wyoming_zeroconf announces a TCP server: set wyoming_uri to tcp://HOST:PORT")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        for name in (
            "max_concurrent_streams",
            "max_connections",
            "max_input_chars",
            "max_body_bytes",
            "max_voices",
            "max_voice_text_chars",
            "ws_max_message_bytes",
            "ws_max_text_chars",
            "ws_max_pending_sentences",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "max_queue_wait_s",
            "max_buffered_audio_s",
            "send_timeout_s",
            "header_timeout_s",
            "body_timeout_s",
            "shutdown_timeout_s",
            "max_upload_seconds",
            "ws_idle_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def voices_path(self) -> str:
        """Where the voices database lives (``voices_db``, or the user's data directory)."""
        if self.voices_db is not None:
            return self.voices_db
        import platformdirs

        directory = platformdirs.user_data_path("chattts-serve", appauthor=False, ensure_exists=True)
        return str(directory / "voices.sqlite3")

    @classmethod
    def server_fields(cls) -> list:
        """The server's own fields (each is a flag and an environment variable)."""
        return [f for f in fields(cls) if f.name != "engine"]

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> ServerConfig:
        """Defaults, then CHATTTS_SERVE_* environment variables, then explicit overrides (server fields
        and flat engine options; None values are skipped)."""
        environ = os.environ if environ is None else environ
        defaults = {f.name: f.default for f in cls.server_fields()} | flat_defaults()
        unknown = set(overrides) - set(defaults)
        if unknown:
            raise ValueError(f"unknown server option(s): {', '.join(sorted(unknown))}")
        values = {}
        for name, default in defaults.items():
            raw = environ.get(ENV_PREFIX + name.upper())
            if raw is not None:
                values[name] = _parse(raw, default)
        values.update({k: v for k, v in overrides.items() if v is not None})
        engine = from_flat(None, **{k: v for k, v in values.items() if k in FLAT_OPTIONS})
        return cls(**{k: v for k, v in values.items() if k not in FLAT_OPTIONS}, engine=engine)


def _check_wyoming_uri(uri: str) -> None:
    """tcp://HOST:PORT or unix://PATH (the Wyoming library's stdio:// serves one client: not a server's)."""
    try:
        parts = urlsplit(uri)
        ok = (parts.scheme == "tcp" and parts.hostname and parts.port) or (parts.scheme == "unix" and parts.path)
    except ValueError:  # a port that is not a number
        ok = False
    if not ok:
        raise ValueError(f"wyoming_uri must be tcp://HOST:PORT or unix://PATH, got {uri!r}")


def _parse(raw: str, default: Any) -> Any:
    if isinstance(default, bool):
        return raw.strip().lower() in ("1", "true", "yes", "on")
    if isinstance(default, int):
        return int(raw)
    if isinstance(default, float):
        return float(raw)
    if isinstance(default, tuple):
        return tuple(k.strip() for k in raw.split(",") if k.strip())
    return raw
