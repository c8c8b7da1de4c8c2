"""``POST /v1/dialogue``: the turns' own audio in order with pauses, run side by side in the engine, streamed
from the first turn's first chunk, a bad turn named, a client that leaves aborting every turn."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import numpy as np
import pytest

from chattts_serve.audio.policy import StreamPolicy
from chattts_serve.engine.async_engine import EngineError
from chattts_serve.engine.outputs import RequestOutput
from chattts_serve.engine.scheduler import QueueFullError
from chattts_serve.sampling_params import SamplingParams
from chattts_serve.server.dialogue import Turn, spoken
from chattts_serve.server.errors import APIError

from .conftest import HTTP_TIMEOUT, SR, check_openai_error, metric, metrics_text, tts_body, wait_until

QUICK_START = {"first_chunk": 1, "max_chunk": 32, "left_context": 4, "lookahead": 1, "crossfade": 0}
TURNS = [
    tts_body(40, "今天天气真不错。", voice="alloy", seed=1),
    tts_body(30, "是啊，我们去公园吧。", voice="nova", seed=2),
    tts_body(20, "好的，走吧。", voice="alloy", seed=3),
]


def _turn(body: dict) -> dict:
    """A /v1/tts body as a dialogue turn (the format is the dialogue's)."""
    return {k: v for k, v in body.items() if k != "format"}


def test_dialogue_is_the_turns_audio_with_pauses(http):
    alone = []
    for body in TURNS:
        r = http.post("/v1/tts", json=body)
        assert r.status_code == 200, r.text
        alone.append(r.content)
    assert http.post("/v1/tts", json={**TURNS[0], "voice": "nova"}).content != alone[0]  # two voices indeed
    pause = b"\0\0" * (SR * 250 // 1000)
    expected = pause.join(alone)
    for stream in (True, False):
        r = http.post(
            "/v1/dialogue",
            json={"turns": [_turn(b) for b in TURNS], "format": "pcm", "pause_ms": 250, "stream": stream},
        )
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("audio/pcm")
        assert r.content == expected  # byte for byte: each turn as spoken alone, in its voice
    r = http.post("/v1/dialogue", json={"turns": [_turn(b) for b in TURNS], "format": "pcm", "pause_ms": 0})
    assert r.content == b"".join(alone)


def test_dialogue_turns_run_together_and_a_disconnect_aborts_them_all(server):
    aborted = metric(server, "chattts_aborted_requests_total")
    aborted_status = metric(server, "chattts_requests_total", {"endpoint": "dialogue", "status": "aborted"})
    long = {"min_new_tokens": 2000, "max_new_tokens": 2000}
    turns = [_turn({**b, **long}) for b in TURNS]
    with httpx.Client(timeout=HTTP_TIMEOUT) as c:
        body = {"turns": turns, "format": "pcm", "chunking": QUICK_START}
        with c.stream("POST", server + "/v1/dialogue", json=body) as r:
            assert r.status_code == 200
            chunks = r.iter_raw()  # keep a reference: a dropped iterator closes the connection
            assert len(next(chunks)) > 0
            # The first turn's audio is out while every turn holds a KV slot: they decode side by side, and
            # the last turn (2000 steps) is far from done.
            assert wait_until(lambda: metric(server, "chattts_kv_slots_used") == 3, timeout=30), metrics_text(server)
            assert metric(server, "chattts_requests_in_flight") == 1  # the dialogue is one request to the limits
    # Every turn was asked for 2000 steps: the slots free long before they could have finished on their own.
    assert wait_until(lambda: metric(server, "chattts_kv_slots_used") == 0, timeout=30), metrics_text(server)
    assert wait_until(lambda: metric(server, "chattts_aborted_requests_total") == aborted + 1, timeout=30)
    assert metric(server, "chattts_requests_total", {"endpoint": "dialogue", "status": "aborted"}) == aborted_status + 1
    assert metric(server, "chattts_requests_in_flight") == 0


def test_bad_turn_is_a_400_naming_it(http):
    def post(*turns, **extra):
        return http.post("/v1/dialogue", json={"turns": list(turns), "format": "pcm", **extra})

    ok = _turn(TURNS[0])
    err = check_openai_error(post(ok, {**ok, "voice": "no-such-voice"}), 400)
    assert err["param"] == "turns.1.voice" and err["message"].startswith("turn 1: unknown voice"), err
    err = check_openai_error(post(ok, ok, {**ok, "temperature": -1}), 400)
    assert err["param"] == "turns.2.temperature", err
    err = check_openai_error(post({**ok, "text": "好" * 5000}), 400)
    assert err["param"] == "turns.0.text" and err["code"] == "input_too_long", err
    # refused by the engine as the turn is submitted (an unknown control token in its prompt)
    err = check_openai_error(post(ok, ok, {**ok, "prompt": "[nope]"}), 400)
    assert err["param"] == "turns.2" and err["message"].startswith("turn 2: prompt has unknown"), err
    check_openai_error(post(*[ok] * 33), 400)
    check_openai_error(post(), 400)
    check_openai_error(post(ok, pause_ms=5001), 400)
    check_openai_error(post(ok, format="mp3", sample_rate=8000), 400)


def test_dialogue_is_documented(http):
    doc = http.get("/openapi.json").json()
    op = doc["paths"]["/v1/dialogue"]["post"]
    assert "audio/pcm" in op["responses"]["200"]["content"] and "400" in op["responses"]
    assert "DialogueRequest" in doc["components"]["schemas"]


# ------------------------------------------------------------------ spoken(): the turns' outputs as one stream


class _Engine:
    """Streams scripted per text: outputs, errors raised, events waited on. Records which streams closed."""

    sample_rate = 24000

    def __init__(self, script: dict) -> None:
        self.script, self.closed = script, []

    def stream(self, text, params, *, request_id, policy):
        return self._outputs(text, request_id)

    async def _outputs(self, text, request_id):
        try:
            for item in self.script[text]:
                if isinstance(item, asyncio.Event):
                    await item.wait()
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            self.closed.append(request_id)


def _out(samples: int, finished: bool = False, reason: str | None = None) -> RequestOutput:
    audio = np.arange(1, samples + 1, dtype=np.float32)
    return RequestOutput("engine-id", audio, finished=finished, finish_reason=reason)


def _spoken(engine: _Engine, *texts: str, pause: int = 0):
    turns = [Turn(t, SamplingParams()) for t in texts]
    return spoken(engine, turns, StreamPolicy(), "d", pause)


async def _all(outputs) -> list[RequestOutput]:
    async with contextlib.aclosing(outputs) as it:
        return [o async for o in it]


def test_spoken_turns_in_order_with_pauses_and_one_end():
    engine = _Engine({"a": [_out(2), _out(3, True, "stop")], "b": [_out(1, True, "length")]})
    outs = asyncio.run(_all(_spoken(engine, "a", "b", pause=4)))
    audio = np.concatenate([o.audio for o in outs])
    assert audio.tolist() == [1, 2, 1, 2, 3, 0, 0, 0, 0, 1]
    assert [o.finished for o in outs] == [False, False, False, True]
    assert outs[-1].finish_reason == "length" and {o.request_id for o in outs} == {"d"}
    assert [o.start_sample for o in outs] == [0, 2, 5, 9] and [o.index for o in outs] == [0, 1, 2, 3]
    assert sorted(engine.closed) == ["d-t0", "d-t1"]


def test_spoken_a_turn_refused_before_the_first_audio_is_a_400_naming_it():
    never = asyncio.Event()
    engine = _Engine({"a": [never, _out(1, True, "stop")], "b": [ValueError("nothing to speak")]})

    async def first():
        outputs = _spoken(engine, "a", "b")
        try:
            await anext(outputs)
        finally:
            await outputs.aclose()

    with pytest.raises(APIError) as err:
        asyncio.run(first())
    assert err.value.status_code == 400 and err.value.param == "turns.1"
    assert str(err.value.detail) == "turn 1: nothing to speak"
    assert sorted(engine.closed) == ["d-t0", "d-t1"]  # the first turn was aborted too


def test_spoken_a_turn_failing_after_the_first_audio_fails_the_stream():
    first_out = asyncio.Event()  # the second turn is refused only once the first turn's audio is out
    engine = _Engine({"a": [_out(2), _out(1, True, "stop")], "b": [first_out, QueueFullError("full")], "c": [_out(5)]})

    async def run():
        got = []
        with pytest.raises(EngineError, match="turn 1: full"):
            async with contextlib.aclosing(_spoken(engine, "a", "b", "c")) as it:
                async for o in it:
                    got.append(o)
                    first_out.set()
        return got

    got = asyncio.run(run())
    assert [len(o.audio) for o in got] == [2, 1]
    assert sorted(engine.closed) == ["d-t0", "d-t1", "d-t2"]  # every turn closed: the running ones aborted
