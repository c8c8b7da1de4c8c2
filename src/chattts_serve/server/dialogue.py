"""``POST /v1/dialogue``: several turns, each in its voice, spoken in order as one audio stream.

Every turn is its own engine request and all of them are submitted at once, so the engine batches them
(the turns run side by side, not one after another). The answer is one request to the client: it holds one
place in the concurrency limits, its metrics are the endpoint ``dialogue``'s, and its audio goes through one
encoder (``AudioResponse``). The first audio leaves with the first turn's first chunk; a later turn's audio
waits in its engine collector until the turns before it are out (at most ``max_buffered_audio_s`` of it, the
engine's guard against a client that stops reading), then follows ``pause_ms`` of silence.

Bounds: at most ``MAX_TURNS`` turns of at most ``max_input_chars`` each, and one audio budget for the whole
dialogue (``server.budget``): the turns and the pauses between them share ``max_audio_seconds``.
A bad turn is a 400 naming it (``param`` ``turns.I...``): its fields, its voice and options are checked before
anything is submitted; what only the engine checks (a text that normalises to nothing, a malformed speaker
string) is found when the turn is submitted. That is before the first turn's first chunk in practice
(preparing a text takes about a millisecond, the first chunk several engine steps), so the answer is still a
400; a refusal after the first audio is out ends the stream as failed. Closing the response (a client that
leaves, a failed turn) aborts every turn's engine request. Dialogues are not looked up in the result cache.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..audio.policy import StreamPolicy
from ..engine.async_engine import EngineError
from ..engine.outputs import RequestOutput
from ..engine.scheduler import QueueFullError
from ..sampling_params import SamplingParams
from ..text.bound import TextTooLong
from .audio_response import AudioResponse
from .budget import turn_budget
from .errors import APIError, TimedStreamingResponse, check_length
from .limits import synthesis
from .openapi import audio_responses, errors
from .params import build_policy, output_rate, resolve_voice, server_params, tenant_of
from .protocol import MEDIA_TYPES, DialogueRequest

router = APIRouter()


@dataclass(frozen=True, slots=True)
class Turn:
    """One turn as the engine takes it."""

    text: str
    params: SamplingParams
    name: str | None = None
    """How a refusal names the turn; None: ``turn I``."""
    param: str | None = None
    """The request field a refusal points at; None: ``turns.I``."""
    max_audio_seconds: float | None = None
    """The turn's share of the request's audio budget (``server.budget``); None: the engine's whole budget."""


def budgeted(engine, turns: list[Turn], pause: int, stretch: float = 1.0, param: str = "turns") -> list[Turn]:
    """``turns`` with their shares of one request's audio budget (``server.budget.turn_budget``): ``pause``
    samples between two, the whole stretched by ``stretch``. A 400 naming ``param`` when they cannot fit."""
    if len(turns) == 1 and stretch >= 1.0:  # one engine request as any: the engine's budget
        return turns
    pause_s = pause * (len(turns) - 1) / engine.sample_rate
    share = turn_budget(engine.max_audio_seconds, [t.params.min_new_tokens for t in turns], pause_s, stretch, param)
    return turns if share is None else [replace(t, max_audio_seconds=share) for t in turns]


@router.post("/v1/dialogue", response_class=Response, responses={**audio_responses(sse=False), **errors(429)})
@synthesis
async def dialogue(body: DialogueRequest, request: Request):
    """The turns in order, each in its voice, ``pause_ms`` of silence between two; streamed by default."""
    st = request.app.state
    output_rate(st.engine, body.format, body.sample_rate)
    pause = body.pause_ms * st.engine.sample_rate // 1000
    turns = await asyncio.to_thread(_turns, st, body, tenant_of(request.scope))  # voices: store reads, blends
    turns = budgeted(st.engine, turns, pause, param="pause_ms")
    policy = build_policy(st.engine.stream_policy, body.chunking)
    rid = request.state.request_id
    resp = AudioResponse(st.engine, st.metrics, st.limits, "dialogue", st.config.timeouts.queue_wait_s)
    await resp.start_outputs(lambda: spoken(st.engine, turns, policy, rid, pause), rid, request)
    if body.stream:
        return TimedStreamingResponse(
            resp.encoded(body.format, body.sample_rate),
            st.config.timeouts.send_s,
            media_type=MEDIA_TYPES[body.format],
            headers=resp.headers,
        )
    return await resp.spooled(body.format, body.sample_rate, request, media_type=MEDIA_TYPES[body.format])


def _turns(st, body: DialogueRequest, tenant: str | None) -> list[Turn]:
    """Each turn's voice and options (on the server's defaults, as ``/v1/tts``'s); a bad one is a 400 that
    names it (``param``: ``turns.I.FIELD``)."""
    cfg = st.config
    turns = []
    for i, turn in enumerate(body.turns):
        try:
            check_length(turn.text, cfg.max_input_chars, "text")
            voice = resolve_voice(st.voices, st.engine, turn.speaker or turn.voice, cfg.voices.default, "voice", tenant)
            params = server_params(st, turn, voice)
        except APIError as exc:
            raise _in_turn(exc, i) from None
        turns.append(Turn(turn.text, params))
    return turns


def _in_turn(exc: APIError, index: int) -> APIError:
    """``exc`` as turn ``index``'s."""
    param = f"turns.{index}.{exc.param}" if exc.param else f"turns.{index}"
    return APIError(exc.status_code, f"turn {index}: {exc.detail}", exc.type, param, exc.code, exc.headers)


async def spoken(
    engine, turns: Sequence[Turn], policy: StreamPolicy, request_id: str, pause: int
) -> AsyncIterator[RequestOutput]:
    """The turns' outputs as one request's: all submitted now, yielded in order with ``pause`` samples of
    silence between two turns; only the last turn's last output is ``finished``. The first output waits for
    the first turn's first chunk, or ends with the error of any turn that failed before it. Closing this
    aborts every turn still running."""
    streams = [
        engine.stream(t.text, t.params, request_id=f"{request_id}-t{i}", policy=policy, **_budget(t))
        for i, t in enumerate(turns)
    ]
    firsts = [asyncio.ensure_future(_opened(s, t, i)) for i, (s, t) in enumerate(zip(streams, turns, strict=True))]
    index = position = sentences = 0
    try:
        await _first_turn_started(firsts)
        for i, (stream, first) in enumerate(zip(streams, firsts, strict=True)):
            if i and pause:
                silence = np.zeros(pause, np.float32)
                rate = engine.sample_rate
                yield RequestOutput(request_id, silence, index=index, start_sample=position, sample_rate=rate)
                index, position = index + 1, position + pause
            try:
                chunk = await first
            except (APIError, QueueFullError) as exc:  # the first turn's audio is out: the stream fails
                detail = str(exc.detail) if isinstance(exc, APIError) else f"{turns[i].name or f'turn {i}'}: {exc}"
                raise EngineError(detail) from None
            last_turn = i == len(turns) - 1
            while True:
                spans = [s.shifted(position - chunk.start_sample, sentences + s.index) for s in chunk.spans]
                out = replace(chunk, request_id=request_id, index=index, start_sample=position, spans=spans)
                if chunk.finished and not last_turn:  # one turn's end is not the dialogue's
                    out = replace(out, finished=False, finish_reason=None, segments=None)
                yield out
                index, position = index + 1, position + len(chunk.audio)
                if chunk.finished:
                    sentences += len(chunk.segments or ())
                    break
                chunk = await anext(stream)
    finally:
        for f in firsts:
            f.cancel()
        for f in firsts:
            with contextlib.suppress(BaseException):  # its error was raised already, or nobody needs it now
                await f
        for s in streams:
            await s.aclose()  # aborts the turn's engine request if it is still running


def _budget(turn: Turn) -> dict:
    """``engine.stream``'s budget argument for ``turn``: none when it has the engine's whole budget."""
    return {} if turn.max_audio_seconds is None else {"max_audio_seconds": turn.max_audio_seconds}


async def _opened(stream: AsyncIterator[RequestOutput], turn: Turn, index: int) -> RequestOutput:
    """A turn's first output; the engine's refusal of its input as a 400 naming the turn."""
    try:
        return await anext(stream)
    except ValueError as exc:
        code = "input_too_long" if isinstance(exc, TextTooLong) else None  # max_input_chars, after an expansion
        message = f"{turn.name or f'turn {index}'}: {exc}"
        raise APIError(400, message, param=turn.param or f"turns.{index}", code=code) from None


async def _first_turn_started(firsts: list[asyncio.Future]) -> None:
    """Until the first turn has its first output; raises the error of any turn that fails before."""
    pending = set(firsts)
    while not firsts[0].done():
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for f in done:
            if f.exception() is not None:
                raise f.exception()
    firsts[0].result()
