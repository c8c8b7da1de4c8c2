"""Native endpoints: ``POST /v1/tts``, every ChatTTS parameter, streamed by default (``"stream": false`` for
one file); ``POST /v1/tts/captioned``, the same as one JSON document with each sentence's timing, or as
subtitles (``server.captions``). SSML that changes voice is spoken as a dialogue (``server.ssml_turns``). The
WebSocket ``/v1/tts/stream`` is in ``server/websocket.py``."""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..audio.encode import check_rate
from ..audio.policy import StreamPolicy
from ..engine.outputs import SegmentSpan
from ..sampling_params import SamplingParams
from .audio_response import AudioResponse, read_spool
from .captions import CAPTION_MEDIA_TYPES, SegmentClock, segment_fields, subtitles
from .dialogue import Turn
from .errors import APIError, ClientGone, TimedStreamingResponse
from .limits import synthesis
from .openapi import audio_responses, errors
from .params import output_rate, tenant_of, tts_params
from .protocol import MEDIA_TYPES, CaptionedRequest, CaptionedSpeech, TTSRequest
from .ssml_turns import start_turns, text_turns

router = APIRouter()
logger = logging.getLogger(__name__)


@router.post("/v1/tts", response_class=Response, responses={**audio_responses(sse=False), **errors(429)})
@synthesis
async def tts(body: TTSRequest, request: Request):
    st = request.app.state
    output_rate(st.engine, body.format, body.sample_rate)
    turns, policy, factor = await _turns(st, body, request, rates_stretched=True)
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
    if body.format not in CAPTION_MEDIA_TYPES:
        output_rate(st.engine, body.format, body.sample_rate)
    if body.caption_unit == "word" and st.engine.family.capabilities.timestamps != "word":
        message = f"caption_unit: this model ({st.engine.family.name}) times sentences, not words"
        raise APIError(400, message, param="caption_unit", code="invalid_request")
    turns, policy, _ = await _turns(st, body, request)  # (no stretch: CaptionedRequest)
    resp = AudioResponse(st.engine, st.metrics, st.limits, "captioned", st.config.timeouts.queue_wait_s)
    await start_turns(resp, st.engine, turns, policy, request.state.request_id, request)
    if body.format in CAPTION_MEDIA_TYPES:
        spans = await _spans(resp, request)
        media_type = f"{CAPTION_MEDIA_TYPES[body.format]}; charset=utf-8"  # SubRip has no other way to say it
        return Response(subtitles(spans, body.format, body.caption_unit), media_type=media_type)
    clock = SegmentClock()
    spool, _ = await resp.spool(body.format, body.sample_rate, request, on_chunk=clock.feed)
    doc = CaptionedSpeech(
        audio="",
        format=body.format,
        sample_rate=check_rate(body.format, body.sample_rate, st.engine.sample_rate),
        duration_s=resp.samples / st.engine.sample_rate,
        segments=[segment_fields(s) for s in clock.spans],
        captions=subtitles(clock.spans, body.captions, body.caption_unit) if body.captions else None,
    ).model_dump_json()
    head = '{"audio":"'  # the audio goes after it, base64, straight from the spool (its field comes first)
    if not doc.startswith(head + '"'):
        raise RuntimeError(f"CaptionedSpeech no longer starts with its audio: {doc[:40]!r}")
    json_body = _json_around(read_spool(spool), head.encode(), doc[len(head) :].encode())
    return TimedStreamingResponse(json_body, st.config.timeouts.send_s, media_type="application/json")


async def _json_around(spool: AsyncIterator[bytes], head: bytes, tail: bytes) -> AsyncIterator[bytes]:
    """``head``, the spool's bytes in base64 (blocks of a multiple of 3 bytes: no padding between), ``tail``:
    a JSON document whose audio never sits in memory whole."""
    yield head
    async for block in spool:
        yield base64.b64encode(block)
    yield tail


async def _turns(
    st, body: TTSRequest, request: Request, rates_stretched: bool = False
) -> tuple[list[Turn], StreamPolicy, float]:
    """The request's turns (``server.ssml_turns``: one, unless its SSML changes voice), chunking and stretch
    (``rates_stretched``: ``tts_params``'s)."""
    tenant = tenant_of(request.scope)
    # voices: store reads, blends
    params, policy, factor = await asyncio.to_thread(tts_params, st, body, tenant, rates_stretched)

    def params_for(voice: str | None) -> SamplingParams:
        if voice is None:
            return params
        return tts_params(st, body.model_copy(update={"voice": voice, "speaker": None}), tenant, rates_stretched)[0]

    return await text_turns(body.text, params_for, "text"), policy, factor


async def _spans(resp: AudioResponse, request: Request) -> list[SegmentSpan]:
    """A started request's sentences' spans (its audio is not kept: subtitles only)."""
    clock = SegmentClock()
    async with aclosing(resp.chunks()) as chunks:
        async for c in chunks:
            clock.feed(c)
            if await request.is_disconnected():  # nobody waits for the subtitles: stop generating them
                raise ClientGone()
    return clock.spans
