"""What the server tells its operator: log records as JSON lines (``--log-format json``), the request id
they carry, secrets masked in every record, and the start-up banner (where it listens, what it runs).

Logging is configured in ``cli.py`` and ``run.py`` only; this module holds the pieces they plug in.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

LOG_FORMATS = ("text", "json")

REQUEST_ID: ContextVar[str | None] = ContextVar("chattts_serve_request_id", default=None)
"""The id of the HTTP request being served (set by the request middleware). A context variable, so it
follows the request into its tasks and worker threads (``asyncio.to_thread`` copies the context), and
is unset in the engine loop thread, which serves many requests at once."""

# Attributes every LogRecord has; anything else on a record came in through ``extra=`` and is kept
# (but not uvicorn's ``color_message``: the message again, with terminal colour codes).
_RECORD_ATTRS = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName", "color_message"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: timestamp (UTC, ISO 8601), level, logger, message, request_id where
    known, the formatted exception if any, and any ``extra=`` fields. Line breaks inside a message or a
    traceback stay escaped inside the JSON string, so one record is always one line for collectors."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "timestamp": datetime.fromtimestamp(record.created, tz=timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None) or REQUEST_ID.get()
        if request_id is not None:
            out["request_id"] = request_id
        for key, value in record.__dict__.items():
            if key not in _RECORD_ATTRS and key not in out:
                out[key] = value
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


# The query string of a path or URL in a message: from its "?" to the next space or quote. Keys travel
# there (``?api_key=`` on a WebSocket) under spellings no list of names catches (``api_k%65y``, which
# parsers decode), and any other value may be private too: none of it is kept.
_QUERY = re.compile(r"(/[^\s?\"'<>]*)\?[^\s\"'<>]+")
_SECRET = re.compile(r"((?:api_key|key|token)=)[^&\s\"']+", re.IGNORECASE)  # outside a URL too


def redact(text: str) -> str:
    """``text`` with every query string and every ``key=``/``token=`` value masked."""
    return _SECRET.sub(r"\1***", _QUERY.sub(r"\1?***", text))


class RedactSecrets(logging.Filter):
    """Masks query strings (and key=, token= values) in log records, in the message and its arguments:
    uvicorn logs each WebSocket handshake with its full path, query string included."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, Mapping):  # ``log("%(name)s", {...})``
            record.args = {k: redact(v) if isinstance(v, str) else v for k, v in record.args.items()}
        elif record.args:
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        return True


def install_log_redaction() -> None:
    """Call after uvicorn configured its loggers (``uvicorn.Config``); again is harmless."""
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "chattts_serve"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactSecrets) for f in logger.filters):
            logger.addFilter(RedactSecrets())


@dataclass(frozen=True, slots=True)
class Banner:
    """What ``chattts-serve serve`` prints once it accepts connections."""

    url: str
    """Where the API listens (http://host:port)."""
    playground: str
    model: str
    device: str
    precision: str
    slots: int
    """KV slots: sequences generated together."""
    auth: bool
    """Whether API keys are required."""

    def text(self) -> str:
        rows = (
            ("listening on", self.url),
            ("playground", self.playground),
            ("model", self.model),
            ("device", self.device),
            ("precision", self.precision),
            ("slots", str(self.slots)),
            ("API keys", "required" if self.auth else "off"),
        )
        width = max(len(name) for name, _ in rows)
        return "chattts-serve is ready\n" + "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)

    def json(self) -> str:
        """The banner as one log line of the JSON format (same keys as every other line)."""
        record = logging.makeLogRecord(
            {"name": "chattts_serve.server", "levelno": logging.INFO, "levelname": "INFO", "msg": "ready"}
        )
        record.__dict__.update(asdict(self))
        return JsonFormatter().format(record)


def listen_url(host: str, port: int) -> str:
    """``http://host:port``, with an IPv6 host in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
