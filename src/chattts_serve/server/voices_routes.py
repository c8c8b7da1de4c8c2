"""Saved voices: ``GET/POST /v1/voices``, ``GET/DELETE /v1/voices/{name}``.

POST takes JSON (``{"name", "speaker"}`` or ``{"name", "seed"}``) or a multipart form with ``name``,
an audio ``file`` (any format ffmpeg reads) and its transcript ``text`` (a zero-shot voice sample).
"""

from __future__ import annotations

import io
import json

import numpy as np
from fastapi import APIRouter, Request
from pydantic import ValidationError

from ..model.config import SAMPLE_RATE
from ..model.speaker import decode_speaker
from .protocol import Voice, VoiceCreate
from .service import APIError
from .voices import VoiceExistsError, VoiceRecord

router = APIRouter()
MAX_UPLOAD_SECONDS = 30


def _public(rec: VoiceRecord) -> Voice:
    return Voice(
        name=rec.name,
        kind=rec.kind,
        speaker=rec.speaker,
        sample_text=rec.sample_text,
        description=rec.description,
        created_at=rec.created_at,
    )


@router.get("/v1/voices")
async def list_voices(request: Request):
    return {"object": "list", "data": [_public(r) for r in request.app.state.voices.list()]}


@router.get("/v1/voices/{name}")
async def get_voice(name: str, request: Request) -> Voice:
    rec = request.app.state.voices.get(name)
    if rec is None:
        raise APIError(404, f"no voice {name!r}", code="voice_not_found")
    return _public(rec)


@router.delete("/v1/voices/{name}")
async def delete_voice(name: str, request: Request):
    if not request.app.state.voices.delete(name):
        raise APIError(404, f"no voice {name!r}", code="voice_not_found")
    return {"deleted": name}


@router.post("/v1/voices", status_code=201)
async def create_voice(request: Request) -> Voice:
    st = request.app.state
    ctype = request.headers.get("content-type", "")
    if ctype.startswith("multipart/form-data"):
        form = await request.form()
        name, text, upload = form.get("name"), form.get("text") or "", form.get("file")
        try:
            VoiceCreate(name=name if isinstance(name, str) else "")
        except ValidationError as exc:
            raise APIError(400, f"name: {exc.errors()[0]['msg']}", param="name") from None
        if upload is None or isinstance(upload, str):
            raise APIError(400, "multipart voice upload needs an audio 'file'", param="file")
        wav = _decode_audio(await upload.read())
        codes = await st.engine.speaker_from_audio(wav)
        return _add(st, name, sample_codes=codes, sample_text=str(text))
    try:
        body = VoiceCreate(**json.loads(await request.body()))
    except (ValueError, TypeError) as exc:
        msg = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else "body must be a JSON object"
        raise APIError(400, msg) from None
    if (body.speaker is None) == (body.seed is None):
        raise APIError(400, "give exactly one of 'speaker' or 'seed'")
    if body.speaker is not None:
        try:
            decode_speaker(body.speaker, expected_dim=st.engine.hidden_size)
        except ValueError as exc:
            raise APIError(400, str(exc), param="speaker") from None
        speaker = body.speaker
    else:
        try:
            speaker = st.engine.sample_speaker(body.seed)
        except ValueError as exc:
            raise APIError(400, str(exc), param="seed") from None
    return _add(st, body.name, speaker=speaker, description=body.description)


def _add(st, name: str, **kw) -> Voice:
    try:
        return _public(st.voices.add(name, **kw))
    except VoiceExistsError as exc:
        raise APIError(409, str(exc), code="voice_exists") from None


def _decode_audio(data: bytes) -> np.ndarray:
    """Any audio file -> 24 kHz mono float32 (PyAV)."""
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            stream = next(s for s in container.streams if s.type == "audio")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
            parts = []
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    parts.append(out.to_ndarray().reshape(-1))
            for out in resampler.resample(None):
                parts.append(out.to_ndarray().reshape(-1))
    except Exception as exc:  # noqa: BLE001 - anything ffmpeg cannot read is the client's problem
        raise APIError(400, f"cannot decode the uploaded audio ({type(exc).__name__})", param="file") from None
    wav = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    if len(wav) < SAMPLE_RATE // 4:
        raise APIError(400, "the uploaded audio is shorter than 0.25 s", param="file")
    return wav[: MAX_UPLOAD_SECONDS * SAMPLE_RATE]
