"""Native endpoints: ``POST /v1/tts``, every ChatTTS parameter, streamed by default (``"stream": false`` for
one file); ``POST /v1/tts/captioned``, the same as one JSON document with each sentence's timing, or as
subtitles (``server.captions``). SSML that changes voice is spoken as a dialogue (``server.ssml_turns``). The
WebSocket ``/v1/tts/stream`` is in ``server/websocket.py``."""

from __future__ import annotations

import asyncio
import base64
import logging
from contextlib import aclosing

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..audio.encode import check_rate, encode_whole
from ..audio.policy import StreamPolicy
from ..engine.outputs import SegmentSpan
from ..model.config import SAMPLE_RATE
from ..sampling_params import SamplingParams
from .audio_response import AudioResponse
from .captions import CAPTION_MEDIA_TYPES, SegmentClock, segment_fields, subtitles
from .dialogue import Turn
from .errors import ClientGone, TimedStreamingResponse
from .limits import synthesis
from .openapi import audio_responses, errors
from .params import tenant_of, tts_params
from .protocol import MEDIA_TYPES, CaptionedRequest, CaptionedSpeech, TTSRequest
from .ssml_turns import start_turns, text_turns

router = APIRouter()
logger = logging.getLogger(__name__)


@router.post("/v1/tts", response_class=Response, responses={**audio_responses(sse=False), **errors(429)})
@synthesis
async def tts(body: TTSRequest, request: Request):
    st = request.app.state
    turns, policy, factor = _turns(st, body, request)
    resp = AudioResponse(st.engine, st.metrics, st.limits, "tts", st.config.timeouts.queue_wait_s)
    await start_turns(resp, st.engine, turns, policy, request.state.request_id, request, factor)
    if body.stream:
        return TimedStreamingResponse(
            resp.encoded(body.format, body.sample_rate, stretch=factor),
            st.config.timeouts.send_s,
            media_type=MEDIA_TYPES[body.format],
            headers=resp.headers,
        )
    return await resp.spooled(body.format, body.sample_rate, request, factor, MEDIA_TYPES[body.format])


@router.post(
    "/v1/tts/captioned",
    response_model=CaptionedSpeech,
    responses={
        200: {
            "description": "The audio and each sentence's timing (JSON), or subtitles (format srt or vtt)",
            "content": {m: {"schema": {"type": "string"}} for m in CAPTION_MEDIA_TYPES.values()},
        },
        **errors(429),
    },
)
@synthesis
async def tts_captioned(body: CaptionedRequest, request: Request):
    """The whole audio (base64, in ``format``) with each sentence's start and end (``server.captions``); with
    ``format`` srt or vtt, only the subtitles."""
    st = request.app.state
    turns, policy, _ = _turns(st, body, request)  # (no stretch: CaptionedRequest)
    resp = AudioResponse(st.engine, st.metrics, st.limits, "captioned", st.config.timeouts.queue_wait_s)
    await start_turns(resp, st.engine, turns, policy, request.state.request_id, request)
    audio, spans = await _whole(resp, request)
    if body.format in CAPTION_MEDIA_TYPES:
        media_type = f"{CAPTION_MEDIA_TYPES[body.format]}; charset=utf-8"  # SubRip has no other way to say it
        return Response(subtitles(spans, body.format), media_type=media_type)
    data = await asyncio.to_thread(encode_whole, audio, body.format, body.sample_rate)
    return CaptionedSpeech(
        audio=base64.b64encode(data).decode(),
        format=body.format,
        sample_rate=check_rate(body.format, body.sample_rate),
        duration_s=len(audio) / SAMPLE_RATE,
        segments=[segment_fields(s) for s in spans],
        captions=subtitles(spans, body.captions) if body.captions else None,
    )


def _turns(st, body: TTSRequest, request: Request) -> tuple[list[Turn], StreamPolicy, float]:
    """The request's turns (``server.ssml_turns``: one, unless its SSML changes voice), chunking and stretch."""
    tenant = tenant_of(request.scope)
    params, policy, factor = tts_params(st, body, tenant)

    def params_for(voice: str | None) -> SamplingParams:
        if voice is None:
            return params
        return tts_params(st, body.model_copy(update={"voice": voice, "speaker": None}), tenant)[0]

    return text_turns(body.text, params_for, "text"), policy, factor


async def _whole(resp: AudioResponse, request: Request) -> tuple[np.ndarray, list[SegmentSpan]]:
    """All of a started request's audio and its sentences' spans."""
    parts, clock = [], SegmentClock()
    async with aclosing(resp.chunks()) as chunks:
        async for c in chunks:
            parts.append(c.audio)
            clock.feed(c)
            if await request.is_disconnected():  # nobody waits for the whole file: stop generating it
                raise ClientGone()
    return (np.concatenate(parts) if parts else np.zeros(0, np.float32)), clock.spans
