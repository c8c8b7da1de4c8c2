"""What the server tells its operator: the start-up banner (text and JSON) and ``--log-format json``
(one JSON object per line, request ids, secrets still masked)."""

from __future__ import annotations

import json
import logging
import re
import sys

import httpx
import pytest
from websockets.sync.client import connect

from chattts_serve.server.config import ServerConfig
from chattts_serve.server.logs import REQUEST_ID, Banner, JsonFormatter, RedactSecrets, listen_url

from .conftest import HTTP_TIMEOUT, start_server, ws_url


def _record(msg: str, *args, exc_info=None, **extra) -> logging.LogRecord:
    record = logging.LogRecord("chattts_serve.x", logging.WARNING, __file__, 1, msg, args, exc_info)
    record.__dict__.update(extra)
    return record


def test_json_formatter_one_line_with_fields():
    try:
        raise RuntimeError("boom\nsecond line")
    except RuntimeError:
        exc_info = sys.exc_info()
    line = JsonFormatter().format(_record("two\nlines %s", "arg", exc_info=exc_info, slots=4))
    assert "\n" not in line  # a record is always one line, whatever its message or traceback holds
    out = json.loads(line)
    assert out["level"] == "WARNING" and out["logger"] == "chattts_serve.x"
    assert out["message"] == "two\nlines arg"
    assert out["slots"] == 4
    assert "RuntimeError: boom" in out["exc_info"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", out["timestamp"])
    assert "request_id" not in out  # none known outside a request


def test_json_formatter_request_id_from_context():
    token = REQUEST_ID.set("rid-123")
    try:
        out = json.loads(JsonFormatter().format(_record("hello")))
    finally:
        REQUEST_ID.reset(token)
    assert out["request_id"] == "rid-123"
    assert "request_id" not in json.loads(JsonFormatter().format(_record("hello")))


def test_redaction_before_json():
    record = _record('"WebSocket %s" [accepted] token=abc', "/v1/tts/stream?api_key=sekret&x=1")
    RedactSecrets().filter(record)
    out = json.loads(JsonFormatter().format(record))
    assert "sekret" not in out["message"] and "abc" not in out["message"]
    assert '/v1/tts/stream?***"' in out["message"] and "token=***" in out["message"]


@pytest.mark.parametrize(
    "msg, args, logged",
    [
        # uvicorn's handshake line; the key's name spelt with an escape, which parsers decode
        ('%s - "WebSocket %s" [accepted]', ("1.2.3.4:5", "/v1/tts/stream?api_k%65y=sekret&voice=alice"),
         '1.2.3.4:5 - "WebSocket /v1/tts/stream?***" [accepted]'),
        ("GET http://h:8000/v1/tts?voice=alice&a=sekret failed", (), "GET http://h:8000/v1/tts?*** failed"),
        ("%(path)s closed", {"path": "/v1/tts/stream?sekret"}, "/v1/tts/stream?*** closed"),
        ("why? /health? fine", (), "why? /health? fine"),  # no query string: nothing to mask
    ],
)  # fmt: skip
def test_the_whole_query_string_is_masked(msg, args, logged):
    """Any query value may be a secret (``?api_k%65y=<key>`` is a key that no list of names catches): none
    is kept."""
    record = _record(msg)
    record.args = args
    RedactSecrets().filter(record)
    assert record.getMessage() == logged


def test_no_query_value_reaches_the_log(tiny_ckpt, tmp_path):
    """Every line a server logs while serving requests with query strings, from uvicorn's loggers and the
    app's, holds none of their values (in-process: the same loggers and filters as ``serve``)."""
    key = "sekret-query-41"
    lines: list[str] = []
    capture = logging.Handler(logging.DEBUG)
    capture.emit = lambda record: lines.append(record.getMessage())
    loggers = [logging.getLogger(name) for name in ("", "uvicorn", "uvicorn.error")]  # uvicorn's don't propagate
    extra = ("--api-keys", key, "--log-level", "info", "--no-warmup")
    with start_server(tiny_ckpt, tmp_path, *extra, in_process=True) as srv:
        for logger in loggers:
            logger.addHandler(capture)
        app_logger = logging.getLogger("chattts_serve")
        level, _ = app_logger.level, app_logger.setLevel(logging.INFO)  # the app's request lines too
        try:
            with connect(ws_url(srv.base, f"?api_k%65y={key}&voice=alice-77"), open_timeout=10, close_timeout=5):
                pass
            httpx.get(srv.base + "/health?voice=alice-77", timeout=HTTP_TIMEOUT)
        finally:
            app_logger.setLevel(level)
            for logger in loggers:
                logger.removeHandler(capture)
    assert any("/v1/tts/stream?***" in line for line in lines), lines  # the handshake was logged, masked
    assert any("path=/health " in line for line in lines), lines  # and the request
    assert not [line for line in lines if key in line or "alice-77" in line]


def test_log_format_is_checked():
    assert ServerConfig(log_format="json").log_format == "json"
    with pytest.raises(ValueError, match="log_format must be one of text, json"):
        ServerConfig(log_format="xml")


def test_banner_text_and_listen_url():
    assert listen_url("::1", 8000) == "http://[::1]:8000"
    banner = Banner("http://0.0.0.0:8000", "http://0.0.0.0:8000/", "./ckpt", "cuda:0", "bf16", 16, True)
    text = banner.text()
    for row in ("listening on  http://0.0.0.0:8000", "playground    http://0.0.0.0:8000/", "precision     bf16"):
        assert row in text
    assert "slots         16" in text and "API keys      required" in text
    assert json.loads(banner.json())["slots"] == 16


@pytest.mark.integration
def test_serve_prints_banner(tiny_ckpt, tmp_path):
    with start_server(tiny_ckpt, tmp_path, "--max-num-seqs", "3", "--no-warmup") as srv:
        assert httpx.get(srv.base + "/health", timeout=HTTP_TIMEOUT).status_code == 200
        log = srv.log()
    assert "chattts-serve is ready" in log
    for row in (
        f"listening on  {srv.base}\n",
        f"playground    {srv.base}/\n",
        f"model         {tiny_ckpt}\n",
        "device        cpu\n",
        "precision     fp32\n",
        "slots         3\n",
        "API keys      off\n",
    ):
        assert row in log, (row, log)


@pytest.mark.integration
def test_serve_json_logs(tiny_ckpt, tmp_path):
    key = "sekret-json-77"
    extra = ("--api-keys", key, "--log-format", "json", "--log-level", "info", "--no-warmup", "--max-num-seqs", "2")
    with start_server(tiny_ckpt, tmp_path, *extra) as srv:
        with httpx.Client(base_url=srv.base, timeout=HTTP_TIMEOUT) as c:
            r = c.get("/v1/models", headers={"Authorization": f"Bearer {key}", "X-Request-ID": "client-7"})
            assert r.status_code == 200
        # uvicorn logs a WebSocket handshake with its query string, where browsers put the key ...
        with connect(ws_url(srv.base, f"?api_key={key}"), open_timeout=10, close_timeout=5):
            pass
        log = srv.log()
    lines = [json.loads(line) for line in log.splitlines() if line.strip()]  # every line is one JSON object
    assert "/v1/tts/stream?***" in log and key not in log  # ... masked in JSON lines too
    for line in lines:
        assert {"timestamp", "level", "logger", "message"} <= set(line), line
    [banner] = [line for line in lines if line["message"] == "ready" and "url" in line]
    assert banner["url"] == srv.base and banner["playground"] == srv.base + "/"
    assert (banner["slots"], banner["precision"], banner["auth"]) == (2, "fp32", True)
    assert any(line["logger"].startswith("uvicorn") for line in lines)  # uvicorn's own lines are JSON too
    [access] = [line for line in lines if "client_request_id=client-7" in line["message"]]
    assert re.fullmatch(r"[0-9a-f]{16}", access["request_id"])
    assert f"request_id={access['request_id']}" in access["message"]
