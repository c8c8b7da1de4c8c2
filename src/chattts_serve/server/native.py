"""Native endpoints: ``POST /v1/tts`` (every ChatTTS parameter, streamed by default) and the WebSocket
``/v1/tts/stream`` (text in, optionally in pieces; audio chunks out with small JSON events)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from dataclasses import replace

import numpy as np
from fastapi import APIRouter, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from ..audio.encode import StreamingEncoder, encode_whole
from ..engine.pipeline import MIN_VOICE_SAMPLES
from .protocol import MEDIA_TYPES, TTSRequest
from .service import APIError, AudioResponse, build_params, build_policy, check_length, resolve_voice

router = APIRouter()
logger = logging.getLogger(__name__)
_SENTENCE_END = re.compile(r"[。！？!?.\n]")
_NO_INITIAL_TEXT = "-"
"""Stands in for the required ``text`` when a WebSocket start message has none; only validated, never spoken."""


def _voice_and_params(st, body: TTSRequest):
    cfg = st.config
    check_length(body.text, cfg.max_input_chars, "text")
    voice = resolve_voice(st.voices, st.engine, body.speaker or body.voice, cfg.default_voice, "voice")
    return build_params(body, voice), build_policy(st.engine.stream_policy, body.chunking)


@router.post("/v1/tts")
async def tts(body: TTSRequest, request: Request):
    st = request.app.state
    params, policy = _voice_and_params(st, body)
    resp = AudioResponse(st.engine, st.metrics, st.limits, "tts", st.config.max_queue_wait_s)
    await resp.start(body.text, params, policy, request.state.request_id)
    if body.stream:
        return StreamingResponse(resp.encoded(body.format), media_type=MEDIA_TYPES[body.format])
    parts = [c.audio async for c in resp.chunks()]
    audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    return Response(encode_whole(audio, body.format), media_type=MEDIA_TYPES[body.format])


@router.websocket("/v1/tts/stream")
async def tts_stream(ws: WebSocket):
    st = ws.app.state
    cfg = st.config
    await ws.accept()
    if cfg.api_keys:
        auth = ws.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ws.query_params.get("api_key")
        if key not in cfg.api_keys:
            await _send_error(ws, "missing or invalid API key", 1008)
            return
    try:
        first = json.loads(await ws.receive_text())
        if not isinstance(first, dict) or first.pop("type", None) != "start":
            raise ValueError('the first message must be {"type": "start", ...options}')
        # The initial text is optional (it may all come in "text" messages), but TTSRequest requires one: a
        # start without it is validated with a placeholder that is never spoken. A text that is given, "-"
        # included, is validated and kept as it is.
        has_initial_text = "text" in first
        first.setdefault("text", _NO_INITIAL_TEXT)
        first.setdefault("format", "pcm")
        body = TTSRequest(**first)
        params, policy = _voice_and_params(st, body)
    except (ValueError, ValidationError, APIError) as exc:
        await _send_error(ws, str(getattr(exc, "detail", exc)), 1008)
        return
    except WebSocketDisconnect:
        return

    session = uuid.uuid4().hex[:12]
    sentences: asyncio.Queue[str | None] = asyncio.Queue()
    initial = first["text"] if has_initial_text else ""

    async def reader():
        buffer = initial
        try:
            while True:
                msg = json.loads(await ws.receive_text())
                kind = msg.get("type") if isinstance(msg, dict) else None
                if kind == "text" and isinstance(msg.get("text"), str):
                    buffer += msg["text"]
                    cut = max((m.end() for m in _SENTENCE_END.finditer(buffer)), default=0)
                    if cut:
                        await sentences.put(buffer[:cut])
                        buffer = buffer[cut:]
                elif kind == "end":
                    if buffer.strip():
                        await sentences.put(buffer)
                    await sentences.put(None)
                    return
                else:
                    await sentences.put(ValueError(f"unexpected message {msg!r}"))
                    return
        except (WebSocketDisconnect, json.JSONDecodeError, RuntimeError) as exc:
            await sentences.put(exc if isinstance(exc, json.JSONDecodeError) else None)

    reading = asyncio.create_task(reader())
    await ws.send_text(
        json.dumps({"type": "start", "session_id": session, "format": body.format, "sample_rate": 24000})
    )
    index, total = 0, 0
    try:
        part = 0
        while True:
            text = await sentences.get()
            if text is None:
                break
            if isinstance(text, Exception):
                await _send_error(ws, f"bad message: {text}", 1008)
                return
            if not text.strip() or not _speakable(text):
                continue
            resp = AudioResponse(st.engine, st.metrics, st.limits, "ws", cfg.max_queue_wait_s)
            try:
                await resp.start(text, params, policy, f"{session}-{part}")
            except APIError as exc:
                if exc.status_code == 400:
                    await ws.send_text(json.dumps({"type": "error", "message": str(exc.detail), "text": text}))
                    continue
                raise
            part += 1
            encoder = StreamingEncoder(body.format)
            first_part_audio = [] if _voice_from_first_part(params) else None
            async for chunk in resp.chunks():
                if first_part_audio is not None:
                    first_part_audio.append(chunk.audio)
                    if chunk.finished and chunk.finish_reason in ("stop", "length"):
                        params = await _with_first_part_voice(st, params, chunk, first_part_audio)
                data = encoder.write(chunk.audio) + (encoder.finish() if chunk.finished else b"")
                total += len(chunk.audio)
                await ws.send_text(
                    json.dumps(
                        {
                            "type": "chunk",
                            "index": index,
                            "samples": len(chunk.audio),
                            "bytes": len(data),
                            "elapsed_s": round(chunk.elapsed_s, 4),
                            "part": part - 1,
                        }
                    )
                )
                if data:
                    await ws.send_bytes(data)
                index += 1
        await ws.send_text(json.dumps({"type": "end", "chunks": index, "audio_seconds": total / 24000}))
        await ws.close()
    except WebSocketDisconnect:
        pass
    except APIError as exc:
        await _send_error(ws, str(exc.detail), 1013)
    finally:
        reading.cancel()


def _voice_from_first_part(params) -> bool:
    return params.split_text and params.first_sentence_voice and params.speaker_sample is None


async def _with_first_part_voice(st, params, final, audio: list[np.ndarray]):
    """The session's voice, kept from its first part on: every later part is spoken with a voice sample
    of the first part's audio and its text as transcript (the engine's voice step, for text that
    arrives in pieces; the first part itself has already been heard as it was)."""
    if not final.segments:
        return params
    sample = final.voice_sample
    if sample is None:
        wav = np.concatenate(audio) if audio else np.zeros(0, np.float32)
        if len(wav) < MIN_VOICE_SAMPLES:
            return params
        sample = await st.engine.speaker_from_audio(wav)
    return replace(params, speaker_sample=sample, speaker_sample_text=final.segments[0].text)


def _speakable(text: str) -> bool:
    return any(ch.isalnum() for ch in text)


async def _send_error(ws: WebSocket, message: str, code: int) -> None:
    try:
        await ws.send_text(json.dumps({"type": "error", "message": message}))
        await ws.close(code=code)
    except (WebSocketDisconnect, RuntimeError):
        pass
