"""Overload (429 / 503 with Retry-After), client disconnects (the KV slot is freed), metrics,
X-Request-ID, and graceful shutdown on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from .conftest import (
    HTTP_TIMEOUT,
    check_openai_error,
    expected_samples,
    metric,
    metrics_text,
    start_server,
    tts_body,
    wait_until,
    ws_url,
)

TEXT = "今天天气真不错。"


# Small first chunks so a request that holds the slot answers quickly even on a loaded machine.
QUICK_START = {"chunking": {"first_chunk": 1, "max_chunk": 32, "left_context": 4, "lookahead": 1, "crossfade": 0}}


@pytest.fixture(scope="module")
def limited(tiny_ckpt, tmp_path_factory):
    """One KV slot, at most two requests in flight."""
    tmp = tmp_path_factory.mktemp("limited")
    with start_server(
        tiny_ckpt, tmp, "--max-num-seqs", "1", "--max-concurrent-streams", "2", "--no-warmup", in_process=True
    ) as srv:
        yield srv.base


@pytest.fixture(scope="module")
def queued(tiny_ckpt, tmp_path_factory):
    """One KV slot, one waiting sequence, and a short queue wait."""
    tmp = tmp_path_factory.mktemp("queued")
    with start_server(
        tiny_ckpt,
        tmp,
        "--max-num-seqs",
        "1",
        "--max-waiting",
        "1",
        "--max-queue-wait-s",
        "0.5",
        "--max-concurrent-streams",
        "8",
        "--no-warmup",
        in_process=True,
    ) as srv:
        yield srv.base


def _post(base: str, body: dict, barrier: threading.Barrier | None = None) -> httpx.Response:
    if barrier is not None:
        barrier.wait(timeout=30)
    return httpx.post(base + "/v1/tts", json=body, timeout=HTTP_TIMEOUT)


def test_concurrency_limit_gives_429(limited):
    rejected_before = metric(limited, "chattts_rejected_requests_total", {"reason": "concurrency"})
    n, tokens = 6, 200
    barrier = threading.Barrier(n)
    with ThreadPoolExecutor(n) as pool:  # every request is bounded by HTTP_TIMEOUT: nothing hangs
        responses = list(pool.map(lambda _: _post(limited, tts_body(tokens), barrier), range(n)))
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) >= 1 and statuses.count(429) >= 1, statuses
    for r in responses:
        if r.status_code == 200:
            assert len(r.content) == 2 * expected_samples(tokens)  # the accepted ones complete
        else:
            err = check_openai_error(r, 429)
            assert err["type"] == "rate_limit_error"
            assert r.headers["retry-after"] == "1"
    assert wait_until(lambda: metric(limited, "chattts_requests_in_flight") == 0)
    rejected = metric(limited, "chattts_rejected_requests_total", {"reason": "concurrency"}) - rejected_before
    assert rejected == statuses.count(429)  # capacity refusals are counted


def test_held_slots_then_429_then_recovery(limited):
    """Deterministic: two requests in flight (one decoding, one waiting for the slot), a third is refused;
    once the first is closed, the waiting one completes."""
    with httpx.Client(timeout=HTTP_TIMEOUT) as c:
        with c.stream("POST", limited + "/v1/tts", json=tts_body(2000, **QUICK_START)) as first:
            assert first.status_code == 200
            first_chunks = first.iter_raw()  # keep a reference: a dropped iterator closes the connection
            assert next(first_chunks)
            with ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(_post, limited, tts_body(40))
                assert wait_until(lambda: metric(limited, "chattts_requests_in_flight") == 2, timeout=10)
                r = httpx.post(limited + "/v1/tts", json=tts_body(40), timeout=HTTP_TIMEOUT)
                check_openai_error(r, 429)
                assert r.headers["retry-after"] == "1"
                assert not waiting.done()
                first.close()  # abort the first: its slot goes to the waiting request
                second = waiting.result(timeout=HTTP_TIMEOUT)
    assert second.status_code == 200 and len(second.content) == 2 * expected_samples(40)
    assert wait_until(lambda: metric(limited, "chattts_kv_slots_used") == 0)


def test_disconnect_mid_stream_frees_the_slot(limited):
    aborted = metric(limited, "chattts_aborted_requests_total")
    aborted_status = metric(limited, "chattts_requests_total", {"endpoint": "tts", "status": "aborted"})
    with httpx.Client(timeout=HTTP_TIMEOUT) as c:
        with c.stream("POST", limited + "/v1/tts", json=tts_body(2000, **QUICK_START)) as r:
            assert r.status_code == 200
            chunks = r.iter_raw()  # keep a reference: a dropped iterator closes the connection
            assert len(next(chunks)) > 0
            assert metric(limited, "chattts_kv_slots_used") == 1
            assert metric(limited, "chattts_requests_in_flight") == 1
    # The stream asked for 2000 steps: the slot frees long before it could have finished on its own.
    assert wait_until(lambda: metric(limited, "chattts_kv_slots_used") == 0, timeout=30), metrics_text(limited)
    assert wait_until(lambda: metric(limited, "chattts_aborted_requests_total") == aborted + 1, timeout=30)
    assert metric(limited, "chattts_requests_total", {"endpoint": "tts", "status": "aborted"}) == aborted_status + 1
    assert metric(limited, "chattts_requests_in_flight") == 0
    # the server is fine afterwards
    r = httpx.post(limited + "/v1/tts", json=tts_body(40), timeout=HTTP_TIMEOUT)
    assert r.status_code == 200 and len(r.content) == 2 * expected_samples(40)


def test_websocket_disconnect_frees_the_slot(limited):
    aborted_before = metric(limited, "chattts_requests_total", {"endpoint": "ws", "status": "aborted"})
    with connect(limited.replace("http://", "ws://") + "/v1/tts/stream", open_timeout=10, close_timeout=5) as ws:
        ws.send(
            json.dumps(
                {
                    "type": "start",
                    "format": "pcm",
                    "seed": 1,
                    "refine_text": False,
                    "min_new_tokens": 2000,
                    "max_new_tokens": 2000,
                    **QUICK_START,
                }
            )
        )
        ws.send(json.dumps({"type": "text", "text": TEXT}))
        assert json.loads(ws.recv(timeout=HTTP_TIMEOUT))["type"] == "start"
        assert json.loads(ws.recv(timeout=HTTP_TIMEOUT))["type"] == "chunk"
        assert metric(limited, "chattts_kv_slots_used") == 1
    assert wait_until(lambda: metric(limited, "chattts_kv_slots_used") == 0, timeout=5), metrics_text(limited)
    assert wait_until(lambda: metric(limited, "chattts_requests_in_flight") == 0, timeout=5)
    # a client that goes away is an abort, not an error
    assert wait_until(
        lambda: metric(limited, "chattts_requests_total", {"endpoint": "ws", "status": "aborted"}) == aborted_before + 1
    )
    assert metric(limited, "chattts_requests_total", {"endpoint": "ws", "status": "error"}) == 0


def test_metrics_reflect_traffic(limited):
    text = metrics_text(limited)
    assert metric(limited, "chattts_requests_total", {"endpoint": "tts", "status": "length"}, text=text) >= 3
    assert metric(limited, "chattts_requests_total", {"endpoint": "tts", "status": "aborted"}, text=text) >= 1
    assert metric(limited, "chattts_time_to_first_audio_seconds_count", {"endpoint": "tts"}, text=text) >= 4
    assert metric(limited, "chattts_request_latency_seconds_count", {"endpoint": "tts"}, text=text) >= 4
    assert metric(limited, "chattts_audio_seconds_total", text=text) > 3 * expected_samples(40) / 24000
    assert metric(limited, "chattts_real_time_factor_count", text=text) >= 3
    assert metric(limited, "chattts_kv_slots_total", text=text) == 1
    assert metric(limited, "chattts_kv_slots_used", text=text) == 0
    assert metric(limited, "chattts_queue_depth", text=text) == 0
    assert metric(limited, "chattts_running_batch_size", text=text) == 0
    assert metric(limited, "chattts_requests_in_flight", text=text) == 0


async def _burst(base: str, n: int, body: dict) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as client:
        return await asyncio.gather(*(client.post(base + "/v1/tts", json=body) for _ in range(n)))


def test_queue_full_and_queue_wait(queued):
    """The slot is held by a long stream; of three more requests one waits (and gives up after 0.5 s
    with 503) and the others find the waiting queue full (429). Nothing hangs, nothing is a 500."""
    before_full = metric(queued, "chattts_rejected_requests_total", {"reason": "queue_full"})
    before_wait = metric(queued, "chattts_rejected_requests_total", {"reason": "queue_wait"})
    with httpx.Client(timeout=HTTP_TIMEOUT) as c:
        with c.stream("POST", queued + "/v1/tts", json=tts_body(2000, **QUICK_START)) as holder:
            assert holder.status_code == 200
            held = holder.iter_raw()  # keep a reference: a dropped iterator closes the connection
            assert next(held)
            responses = asyncio.run(_burst(queued, 3, tts_body(40)))  # bounded by HTTP_TIMEOUT
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) <= {429, 503}, statuses
    assert 503 in statuses and 429 in statuses, statuses
    for r in responses:
        err = check_openai_error(r, r.status_code)
        assert r.headers["retry-after"] == "1"
        assert err["type"] == ("rate_limit_error" if r.status_code == 429 else "server_error")
    text = metrics_text(queued)
    full = metric(queued, "chattts_rejected_requests_total", {"reason": "queue_full"}, text=text) - before_full
    wait = metric(queued, "chattts_rejected_requests_total", {"reason": "queue_wait"}, text=text) - before_wait
    assert full == statuses.count(429) and wait == statuses.count(503)
    assert metric(queued, "chattts_requests_total", {"endpoint": "tts", "status": "rejected"}, text=text) >= 3
    assert wait_until(lambda: metric(queued, "chattts_kv_slots_used") == 0, timeout=5)
    assert wait_until(lambda: metric(queued, "chattts_queue_depth") == 0, timeout=5)
    # capacity is back
    r = httpx.post(queued + "/v1/tts", json=tts_body(40), timeout=HTTP_TIMEOUT)
    assert r.status_code == 200 and len(r.content) == 2 * expected_samples(40)


def test_burst_on_queued_server(queued):
    """More concurrent requests than slot + queue: every answer is 200, 429 or 503, and the 200s are whole."""
    responses = asyncio.run(_burst(queued, 6, tts_body(150)))
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429, 503}, statuses
    assert 200 in statuses and (429 in statuses or 503 in statuses), statuses
    for r in responses:
        if r.status_code == 200:
            assert len(r.content) == 2 * expected_samples(150)
        else:
            check_openai_error(r, r.status_code)
            assert "retry-after" in r.headers


def test_request_id_on_every_response(server):
    with httpx.Client(base_url=server, timeout=HTTP_TIMEOUT) as c:
        seen = set()
        for method, path, kw in [
            ("GET", "/health", {}),
            ("GET", "/ready", {}),
            ("GET", "/metrics", {}),
            ("GET", "/", {}),
            ("GET", "/v1/models", {}),
            ("GET", "/v1/voices", {}),
            ("GET", "/nope", {}),
            ("POST", "/v1/tts", {"json": tts_body(8)}),
            ("POST", "/v1/tts", {"json": {**tts_body(8), "stream": False}}),
            ("POST", "/v1/tts", {"json": {"text": ""}}),
            (
                "POST",
                "/v1/audio/speech",
                {
                    "json": {
                        "model": "tts-1",
                        "voice": "alloy",
                        "input": "你好。",
                        "max_new_tokens": 8,
                        "refine_text": False,
                        "response_format": "pcm",
                    }
                },
            ),
        ]:
            r = c.request(method, path, **kw)
            ids = r.headers.get_list("x-request-id")
            assert len(ids) == 1 and ids[0], (path, r.headers)
            seen.add(ids[0])
            r = c.request(method, path, headers={"X-Request-ID": f"client-{path}"}, **kw)
            assert r.headers.get_list("x-request-id") == [f"client-{path}"], (path, r.headers)
        assert len(seen) == 11  # generated ids are unique


def test_sigterm_drains_the_stream_and_exits(tiny_ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sigterm")
    tokens = 300
    with start_server(tiny_ckpt, tmp, "--no-warmup", "--log-level", "info") as srv:
        with httpx.Client(timeout=HTTP_TIMEOUT) as c:
            with c.stream("POST", srv.base + "/v1/tts", json=tts_body(tokens)) as r:
                assert r.status_code == 200
                chunks = r.iter_raw()
                body = next(chunks)
                srv.proc.send_signal(signal.SIGTERM)
                for chunk in chunks:  # the in-flight stream is finished, not cut
                    body += chunk
        assert len(body) == 2 * expected_samples(tokens)
        code = srv.proc.wait(timeout=60)  # raises if the server does not exit by itself
        log = srv.log()
    assert code == 0, log  # a graceful stop exits 0
    assert "Application shutdown complete" in log, log
    assert "Traceback" not in log, log
    with pytest.raises(httpx.TransportError):
        httpx.get(srv.base + "/health", timeout=2)


@pytest.mark.integration
def test_sigterm_ends_streams_that_outlast_the_grace_period_visibly(tiny_ckpt, tmp_path_factory):
    """Three long streams (SSE, a chunked body, a WebSocket) when SIGTERM comes with a 4 s grace period:
    each ends in a way its client can tell from success (an SSE error event, a chunked body without its
    last chunk, a WebSocket close 1012), and the server still exits 0."""
    tmp = tmp_path_factory.mktemp("sigterm-long")
    long = {"seed": 1, "refine_text": False, "min_new_tokens": 2000, "max_new_tokens": 2000}
    long["first_sentence_voice"] = False  # audio from the first step on
    text = "今天天气真不错。我们去公园吧。明天见。你好。再见。谢谢。"  # 6 x 2000 steps: far past the grace period
    flags = ("--no-warmup", "--max-num-seqs", "3", "--shutdown-timeout-s", "4", "--log-level", "info")
    flags += ("--max-queue-wait-s", "600")  # a loaded machine must not turn a slow first chunk into a 503
    with start_server(tiny_ckpt, tmp, *flags) as srv:
        speech = {"model": "tts-1", "voice": "alloy", "input": text, "stream_format": "sse", **long}
        ws_options = {"open_timeout": 10, "ping_interval": None}  # no keep-alive pings while it is not read
        with httpx.Client(timeout=HTTP_TIMEOUT) as c, connect(ws_url(srv.base), **ws_options) as ws:
            ws.send(json.dumps({"type": "start", "text": text, "format": "pcm", **long}))
            ws.send(json.dumps({"type": "end"}))
            assert json.loads(ws.recv(timeout=HTTP_TIMEOUT))["type"] == "start"
            while not isinstance(ws.recv(timeout=HTTP_TIMEOUT), bytes):  # until audio flows
                pass

            def rest_of_ws() -> tuple[list, ConnectionClosed]:
                messages = []
                with pytest.raises(ConnectionClosed) as closed:
                    while True:
                        messages.append(ws.recv(timeout=HTTP_TIMEOUT))
                return messages, closed.value

            def rest_of_raw(chunks) -> bytes:
                rest = b""
                with pytest.raises(httpx.RemoteProtocolError):  # the chunked body never gets its last chunk
                    for chunk in chunks:
                        rest += chunk
                return rest

            # Every stream is read all along: none is held up (or timed out) by a reader that waits.
            with ThreadPoolExecutor(2) as pool:
                ws_rest = pool.submit(rest_of_ws)
                with (
                    c.stream("POST", srv.base + "/v1/audio/speech", json=speech) as sse,
                    c.stream("POST", srv.base + "/v1/tts", json={"text": text, "format": "pcm", **long}) as raw,
                ):
                    assert sse.status_code == 200 and raw.status_code == 200
                    lines, raw_chunks = sse.iter_lines(), raw.iter_raw()
                    events = [json.loads(next(line for line in lines if line.startswith("data: "))[6:])]
                    body = next(raw_chunks)
                    srv.proc.send_signal(signal.SIGTERM)
                    raw_rest = pool.submit(rest_of_raw, raw_chunks)
                    with pytest.raises(httpx.RemoteProtocolError):  # after its error event, the SSE body is cut
                        for line in lines:
                            if line.startswith("data: "):
                                events.append(json.loads(line[6:]))
                    body += raw_rest.result(timeout=120)
                messages, closed = ws_rest.result(timeout=120)
        code = srv.proc.wait(timeout=60)
        log = srv.log()
    assert events[0]["type"] == "speech.audio.delta"
    assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "server_shutdown", events[-1]
    assert not any(e["type"] == "speech.audio.done" for e in events)
    assert len(body) < 2 * expected_samples(2000, segments=6)
    # uvicorn closes every WebSocket at once on shutdown, with 1012 (Service Restart): explicit, no "end".
    assert closed.rcvd is not None and closed.rcvd.code == 1012, closed
    assert not any(isinstance(m, str) and json.loads(m).get("type") == "end" for m in messages)
    assert code == 0, log
    assert "unfinished request(s)" in log, log  # the two HTTP streams (and the WebSocket's, if still there)
    assert "Traceback" not in log, log


def test_server_config_refuses_unknown_precision_and_decode():
    import pytest

    from chattts_serve.server.config import ServerConfig

    with pytest.raises(ValueError, match="precision must be one of"):
        ServerConfig.from_env({}, precision="int3")
    with pytest.raises(ValueError, match="decode must be"):
        ServerConfig.from_env({}, decode="graph")
    assert ServerConfig.from_env({"CHATTTS_SERVE_PRECISION": "int8-static"}).engine.precision == "int8-static"
