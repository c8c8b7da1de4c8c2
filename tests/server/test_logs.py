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
    assert "api_key=***&x=1" in out["message"] and "token=***" in out["message"]


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
    assert "api_key=***" in log and key not in log  # ... masked in JSON lines too
    for line in lines:
        assert {"timestamp", "level", "logger", "message"} <= set(line), line
    [banner] = [line for line in lines if line["message"] == "ready" and "url" in line]
    assert banner["url"] == srv.base and banner["playground"] == srv.base + "/"
    assert (banner["slots"], banner["precision"], banner["auth"]) == (2, "fp32", True)
    assert any(line["logger"].startswith("uvicorn") for line in lines)  # uvicorn's own lines are JSON too
    [access] = [line for line in lines if "client_request_id=client-7" in line["message"]]
    assert re.fullmatch(r"[0-9a-f]{16}", access["request_id"])
    assert f"request_id={access['request_id']}" in access["message"]
