"""OpenAI-compatible endpoints: ``POST /v1/audio/speech`` and ``GET /v1/models``. An ``input`` in SSML that
changes voice is spoken as a dialogue (``server.ssml_turns``)."""

from __future__ import annotations

import base64
import json
import time
from dataclasses import asdict

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..audio.stretch import plan_speed
from ..sampling_params import SamplingParams
from .audio_response import AudioResponse
from .captions import SegmentClock, segment_event
from .errors import APIError, ResponseCut, StreamFailed, TimedStreamingResponse, check_length
from .limits import synthesis
from .openapi import audio_responses, errors
from .params import output_rate, resolve_voice, server_params, tenant_of
from .protocol import MEDIA_TYPES, ModelCard, ModelList, SpeechRequest
from .ssml_turns import start_turns, text_turns

router = APIRouter()
OPENAI_MODEL_IDS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
"""OpenAI's model names, accepted for the served model so unmodified clients work."""
MODEL_IDS = ("chattts", *OPENAI_MODEL_IDS)
"""The ids of a ChatTTS server (another family's server lists its family's name first: ``model_ids``)."""
_CREATED = int(time.time())


def model_ids(engine) -> tuple[str, ...]:
    """The model ids a server answers to: its model family's name, then OpenAI's."""
    return (engine.family.name, *OPENAI_MODEL_IDS)


@router.get("/v1/models")
async def models(request: Request) -> ModelList:
    """Every model id, each with the served model's family, sample rate, capabilities, built-in voices and request
    options (what the playground offers)."""
    eng = getattr(request.app.state, "engine", None)
    if eng is None:  # still loading: the ids alone
        return ModelList(data=[ModelCard(id=m, created=_CREATED) for m in MODEL_IDS])
    family, voices = eng.family, eng.voices
    facts = {
        "family": family.name,
        "sample_rate": eng.sample_rate,
        "capabilities": asdict(family.capabilities),
        "voices": [{"name": n, "description": voices.description(n)} for n in voices.builtin],
        "options": [asdict(o) for o in family.request_options()],
        "sample_text": family.sample_text,
    }
    return ModelList(data=[ModelCard(id=m, created=_CREATED, **facts) for m in model_ids(eng)])


@router.post("/v1/audio/speech", response_class=Response, responses={**audio_responses(sse=True), **errors(429)})
@synthesis
async def speech(body: SpeechRequest, request: Request):
    st = request.app.state
    cfg = st.config
    output_rate(st.engine, body.response_format, body.sample_rate)
    ids = model_ids(st.engine)
    if body.model not in ids:
        raise APIError(
            400,
            f"unknown model {body.model!r}; use one of {', '.join(ids)}",
            param="model",
            code="model_not_found",
        )
    check_length(body.input, cfg.max_input_chars, "input")
    tenant = tenant_of(request.scope)
    speed = plan_speed(body.speed, body.speed_mode)  # the [speed_N] prompt implied, and/or a time stretch

    def params_for(voice_name: str | None) -> SamplingParams:
        """The request's params; in voice ``voice_name`` (an SSML <voice>: server.ssml_turns) if one is given."""
        name = body.voice if voice_name is None else voice_name
        voice = resolve_voice(st.voices, st.engine, name, cfg.voices.default, "voice", tenant)
        return server_params(st, body, voice, speed)

    turns = await text_turns(body.input, params_for, "input")
    resp = AudioResponse(st.engine, st.metrics, st.limits, "speech", cfg.timeouts.queue_wait_s)
    rid = request.state.request_id
    await start_turns(resp, st.engine, turns, st.engine.stream_policy, rid, request, speed.stretch, "input")
    timeout = cfg.timeouts.send_s
    if body.stream_format == "sse":
        sse = _sse(resp, body.response_format, body.sample_rate, body.timestamps, speed.stretch)
        return TimedStreamingResponse(sse, timeout, media_type="text/event-stream", headers=resp.headers)
    fmt = body.response_format
    audio = resp.encoded(fmt, body.sample_rate, stretch=speed.stretch)
    return TimedStreamingResponse(audio, timeout, media_type=MEDIA_TYPES[fmt], headers=resp.headers)


async def _sse(resp: AudioResponse, fmt: str, sample_rate: int | None, timestamps: bool = False, stretch: float = 1.0):
    """OpenAI's speech SSE: ``speech.audio.delta`` events with base64 audio, then ``speech.audio.done``. With
    ``timestamps``, a ``speech.segment`` event (ours: ``server.captions``) follows the delta that completes a
    sentence (or a later one, while the encoder still holds the sentence's last samples)."""
    clock = SegmentClock() if timestamps else None
    try:
        async for data in resp.encoded(fmt, sample_rate, clock.feed if clock is not None else None, stretch):
            event = {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}
            yield f"data: {json.dumps(event)}\n\n" + _segment_events(clock)
    except StreamFailed as exc:  # an error event, never a "done" after a failure
        error = {"type": "error", "error": {"message": str(exc.detail), "type": exc.type, "code": exc.code}}
        yield f"data: {json.dumps(error)}\n\n"
        # ... and then the body ends unfinished: clients that ignore error events (LiveKit's OpenAI TTS
        # does) still see a failed request, not a short one.
        raise ResponseCut(str(exc.detail)) from None
    final = resp.final
    tokens_in = final.num_input_tokens if final is not None else 0
    tokens_out = final.num_steps if final is not None else 0  # audio tokens (4 codes = 512 samples each)
    usage = {"input_tokens": tokens_in, "output_tokens": tokens_out, "total_tokens": tokens_in + tokens_out}
    # (sentences completed by a last chunk that encoded to nothing go out before the done event)
    yield _segment_events(clock) + f"data: {json.dumps({'type': 'speech.audio.done', 'usage': usage})}\n\n"


def _segment_events(clock: SegmentClock | None) -> str:
    """The ``speech.segment`` events of the sentences completed since the last call."""
    spans = clock.take() if clock is not None else []
    return "".join(f"data: {json.dumps(segment_event(s, 'speech.segment'))}\n\n" for s in spans)
