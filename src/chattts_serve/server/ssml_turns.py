"""SSML ``<voice>`` on the one-text routes (``POST /v1/audio/speech``, ``/v1/tts``, ``/v1/tts/captioned``): a
document that changes voice is spoken as a dialogue (``server.dialogue``).

The engine speaks one request in one voice. ``text.ssml.voice_runs`` cuts the document where the voice
changes; each run's voice goes through the resolver any voice field does (``params.resolve_voice``: the
tenant's saved voices, OpenAI names, speaker strings, blends), with the request's own options; the runs are
the turns of ``dialogue.spoken``: submitted at once (the engine batches them), spoken in order with
``TURN_PAUSE_MS`` of silence between two (``/v1/dialogue``'s default ``pause_ms``), one audio stream.

A text without ``<voice>`` is one turn, the text itself, on the route's path as before (the result cache
included); so is a document with one run, in that run's voice. A document of several turns is not looked up
in the result cache, as dialogues are not. Splitting happens here, before anything is submitted, so a fault
in the document (malformed, an unknown tag, an unknown voice) is a 400 naming its place in the request's text.
The document is read in a worker thread, as the engine reads text: parsing is never the event loop's work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fastapi import Request

from ..audio.policy import StreamPolicy
from ..sampling_params import SamplingParams
from ..text.ssml import is_ssml, voice_runs
from .audio_response import AudioResponse
from .dialogue import Turn, budgeted, spoken
from .errors import APIError
from .protocol import MAX_TURNS, DialogueRequest

TURN_PAUSE_MS: int = DialogueRequest.model_fields["pause_ms"].default
"""Silence between two voices' turns."""


async def text_turns(text: str, params_for: Callable[[str | None], SamplingParams], param: str) -> list[Turn]:
    """``text`` as the turns to speak. ``params_for(None)``: the request's ``SamplingParams``;
    ``params_for(name)``: the same request in voice ``name`` (a 400 for an unknown voice). ``param``: the
    request's text field, which a refusal points at."""
    # the request's own voice and options are checked whatever its text holds; resolving a voice reads the
    # store and may mix a blend: a worker thread's work, as each <voice> run's below
    params = await asyncio.to_thread(params_for, None)
    if not is_ssml(text) or "voice" not in text:  # no <voice>: the engine reads the SSML, off the event loop
        return [Turn(text, params)]
    try:
        runs = await asyncio.to_thread(voice_runs, text)
    except ValueError as exc:
        raise APIError(400, str(exc), param=param) from None
    if len(runs) > MAX_TURNS:
        message = f"the SSML's <voice> elements make {len(runs)} turns; the limit is {MAX_TURNS}"
        raise APIError(400, message, param=param)
    if len(runs) == 1 and runs[0].voice is None:
        return [Turn(runs[0].ssml, params)]
    turns = []
    for i, run in enumerate(runs):
        if run.voice is None:
            turns.append(Turn(run.ssml, params, f"SSML turn {i} (the request's voice)", param))
            continue
        name = f"SSML turn {i} (<voice> at {run.where})"
        try:
            turns.append(Turn(run.ssml, await asyncio.to_thread(params_for, run.voice), name, param))
        except APIError as exc:
            raise APIError(
                exc.status_code, f"<voice> at {run.where}: {exc.detail}", exc.type, param, exc.code, exc.headers
            ) from None
    return turns


async def start_turns(
    resp: AudioResponse,
    engine,
    turns: list[Turn],
    policy: StreamPolicy,
    request_id: str,
    request: Request,
    stretch: float = 1.0,
    param: str = "text",
) -> None:
    """Start ``resp`` on ``turns``: one turn as any request, several as a dialogue's. The turns, the pauses
    between them and ``stretch`` (the response's time stretch) share one audio budget (``server.budget``)."""
    pause = TURN_PAUSE_MS * engine.sample_rate // 1000 if len(turns) > 1 else 0
    turns = budgeted(engine, turns, pause, stretch, param)
    if len(turns) == 1:
        t = turns[0]
        await resp.start(t.text, t.params, policy, request_id, request, max_audio_seconds=t.max_audio_seconds)
        return
    await resp.start_outputs(lambda: spoken(engine, turns, policy, request_id, pause), request_id, request)
