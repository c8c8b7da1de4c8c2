"""Native endpoint ``POST /v1/tts``: every ChatTTS parameter, streamed by default (``"stream": false`` for
one file). The WebSocket ``/v1/tts/stream`` is in ``server/websocket.py``."""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..audio.encode import encode_whole
from .audio_response import AudioResponse
from .errors import ClientGone, TimedStreamingResponse, check_length
from .limits import synthesis
from .openapi import audio_responses, errors
from .params import build_params, build_policy, request_defaults, resolve_voice, tenant_of
from .protocol import MEDIA_TYPES, TTSRequest

router = APIRouter()
logger = logging.getLogger(__name__)


def _voice_and_params(st, body: TTSRequest, tenant: str | None):
    cfg = st.config
    check_length(body.text, cfg.max_input_chars, "text")
    voice = resolve_voice(st.voices, st.engine, body.speaker or body.voice, cfg.voices.default, "voice", tenant)
    params = build_params(body, voice, defaults=request_defaults(cfg.default_options), lexicon=cfg.lexicon)
    return params, build_policy(st.engine.stream_policy, body.chunking)


@router.post("/v1/tts", response_class=Response, responses={**audio_responses(sse=False), **errors(429)})
@synthesis
async def tts(body: TTSRequest, request: Request):
    st = request.app.state
    params, policy = _voice_and_params(st, body, tenant_of(request.scope))
    resp = AudioResponse(st.engine, st.metrics, st.limits, "tts", st.config.timeouts.queue_wait_s)
    await resp.start(body.text, params, policy, request.state.request_id, request)
    if body.stream:
        return TimedStreamingResponse(
            resp.encoded(body.format, body.sample_rate),
            st.config.timeouts.send_s,
            media_type=MEDIA_TYPES[body.format],
            headers=resp.headers,
        )
    parts = []
    async with aclosing(resp.chunks()) as chunks:
        async for c in chunks:
            parts.append(c.audio)
            if await request.is_disconnected():  # nobody waits for the whole file: stop generating it
                raise ClientGone()
    audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    # encoding is not the event loop's work
    data = await asyncio.to_thread(encode_whole, audio, body.format, body.sample_rate)
    return Response(data, media_type=MEDIA_TYPES[body.format], headers=resp.headers)
