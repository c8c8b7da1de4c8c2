"""Saved voices: ``GET/POST /v1/voices``, ``GET/DELETE /v1/voices/{name}``.

POST takes JSON (``Content-Type: application/json``; ``{"name", "speaker"}`` or ``{"name", "seed"}``, where
``speaker`` is a speaker string or a blend of voices, ``"a(2)+b(1)"``: ``server.blend``, saved as the speaker it
mixes to) or a multipart form with ``name``, an audio ``file`` (wav, flac, mp3, ogg, m4a/mp4, aac, webm/mka) and
its transcript ``text`` (a zero-shot voice sample). GET lists voices by name, a page at a time
(``?limit=``, ``?after=<name>``), in OpenAI's list shape.

Voices belong to the tenant of the request's API key (``params.tenant_of``; none without tenants): each
route sees, counts and changes only that tenant's voices, and ``max_voices`` holds per tenant (a tenant's
own ``max_voices`` when its config sets one). Built-in voice names are not stored: every tenant has them.

Creating a voice is limited work (``limits.limited``): a tenant's limits count it, and an upload holds one
of the server's requests in flight while its audio is decoded and encoded (beyond them: 429), so a flood
of uploads cannot take the worker threads and the engine from synthesis.

Storage errors are JSON errors like any other: a database locked by another writer is a 503 with
Retry-After, a full disk a 507. The store runs in worker threads, so a write that waits for a lock
never holds up the event loop (and with it every audio stream).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging

import numpy as np
from fastapi import APIRouter, Query, Request
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from .blend import is_blend
from .errors import APIError, check_length, storage_error
from .limits import limited
from .openapi import VOICE_UPLOAD_BODY, errors
from .params import resolve_voice, tenant_of
from .protocol import Voice, VoiceCreate
from .voices import VoiceExistsError, VoiceLimitError, VoiceRecord, VoiceStoreError, limit_message

logger = logging.getLogger(__name__)
router = APIRouter()

MIN_UPLOAD_SECONDS = 0.25
# Demuxers ffmpeg may use for an upload: audio containers only. Anything else (ffconcat/concat, hls,
# image2, tty, ...) is refused before its demuxer reads a byte: some of them open other files or URLs.
AUDIO_DEMUXERS = ("wav", "flac", "mp3", "ogg", "mov", "mp4", "m4a", "aac", "matroska", "webm")
# One message for every unreadable upload: it must not tell whether a path exists on the server, nor
# echo ffmpeg's error text.
UNREADABLE_AUDIO = "the file is not audio in an accepted format (wav, flac, mp3, ogg, m4a/mp4, aac, webm)"
NAME_RULE = "use 1-64 ASCII letters, digits, '-', '_' or '.', not starting with '.'"


def _public(rec: VoiceRecord) -> Voice:
    return Voice(
        name=rec.name,
        kind=rec.kind,
        speaker=rec.speaker,
        sample_text=rec.sample_text,
        description=rec.description,
        created_at=rec.created_at,
    )


async def _store(method, *args, **kwargs):
    """A VoiceStore call in a worker thread, its failures as JSON errors."""
    try:
        return await asyncio.to_thread(method, *args, **kwargs)
    except VoiceStoreError as exc:
        raise storage_error(exc) from None


@router.get("/v1/voices", responses=errors())
async def list_voices(
    request: Request,
    limit: int = Query(100, ge=1, le=1000),
    after: str | None = Query(None, max_length=256),
):
    # One row more than the page tells whether another page follows.
    voices = request.app.state.voices
    recs = await _store(voices.list, limit=limit + 1, after=after, tenant=tenant_of(request.scope))
    page = recs[:limit]
    return {
        "object": "list",
        "data": [_public(r) for r in page],
        "first_id": page[0].name if page else None,
        "last_id": page[-1].name if page else None,
        "has_more": len(recs) > limit,
    }


@router.get("/v1/voices/{name}", responses=errors(404))
async def get_voice(name: str, request: Request) -> Voice:
    rec = await _store(request.app.state.voices.get, name, tenant=tenant_of(request.scope))
    if rec is None:
        raise APIError(404, f"no voice {name!r}", code="voice_not_found")
    return _public(rec)


@router.delete("/v1/voices/{name}", responses=errors(404))
async def delete_voice(name: str, request: Request):
    if not await _store(request.app.state.voices.delete, name, tenant=tenant_of(request.scope)):
        raise APIError(404, f"no voice {name!r}", code="voice_not_found")
    return {"deleted": name}


@router.post("/v1/voices", status_code=201, responses=errors(409, 415, 429, 507), openapi_extra=VOICE_UPLOAD_BODY)
@limited
async def create_voice(request: Request) -> Voice:
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media == "multipart/form-data":
        return await _create_from_upload(request)
    if media == "application/json":
        return await _create_from_json(request)
    # Not a JSON body without its media type: a cross-site page can POST text/plain without asking the
    # browser first (no CORS preflight), but not application/json.
    raise APIError(
        415,
        "send application/json (a speaker or seed) or multipart/form-data (an audio sample)",
        code="unsupported_media_type",
    )


# --------------------------------------------------------------------------------------------- JSON


async def _create_from_json(request: Request) -> Voice:
    try:
        body = VoiceCreate.model_validate(json.loads(await request.body()))
    except ValidationError as exc:
        raise _invalid(exc) from None
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested too deep to parse
        raise APIError(400, "body must be a JSON object") from None
    if (body.speaker is None) == (body.seed is None):
        raise APIError(400, "give exactly one of 'speaker' or 'seed'")
    return await _add(request, body.name, speaker=await _speaker(request, body), description=body.description)


async def _speaker(request: Request, body: VoiceCreate) -> str:
    st = request.app.state
    if body.seed is not None:
        try:
            return st.engine.sample_speaker(body.seed)
        except ValueError as exc:
            raise APIError(400, str(exc), param="seed") from None
    speaker = body.speaker
    if is_blend(speaker):
        # A blend is saved as the speaker it mixes to now: the voice stays as it is if a part is deleted later.
        # In a worker thread: the parts are read from the store (as every route here does).
        voice = await asyncio.to_thread(
            resolve_voice, st.voices, st.engine, speaker, None, "speaker", tenant_of(request.scope)
        )
        if voice.speaker is None:  # "a(1)": one voice, a voice sample or a built-in without an embedding
            raise APIError(400, "the voice is not a speaker embedding: it cannot be saved as one", param="speaker")
        speaker = voice.speaker
    try:
        st.engine.voices.check(speaker)  # the model family's voice codec (ChatTTS: a speaker string)
    except ValueError as exc:
        raise APIError(400, str(exc), param="speaker") from None
    return speaker


def _invalid(exc: ValidationError) -> APIError:
    err = exc.errors()[0]
    param = ".".join(str(x) for x in err.get("loc", ())) or None
    msg = NAME_RULE if param == "name" and err.get("type") == "string_pattern_mismatch" else err["msg"]
    return APIError(400, f"{param}: {msg}" if param else msg, param=param)


def _max_voices(request: Request) -> int:
    """The voices the request's tenant may have: its own cap when the tenant limits set one
    (``scope["state"]["max_voices"]``), else the server's (which holds per tenant)."""
    return request.scope.get("state", {}).get("max_voices") or request.app.state.config.voices.max_count


async def _add(request: Request, name: str, **kw) -> Voice:
    st, tenant = request.app.state, tenant_of(request.scope)
    try:
        return _public(await _store(st.voices.add, name, max_voices=_max_voices(request), tenant=tenant, **kw))
    except VoiceExistsError as exc:
        raise APIError(409, str(exc), code="voice_exists") from None
    except VoiceLimitError as exc:
        # 409, not 507: the client can resolve it (delete a voice), and a 5xx invites blind retries.
        raise APIError(409, str(exc), code="voice_limit_reached") from None


# ---------------------------------------------------------------------------------------- multipart


async def _create_from_upload(request: Request) -> Voice:
    st, cfg = request.app.state, request.app.state.config
    # Two files at most: the audio, and a transcript mistakenly sent as a file (refused below, by name).
    async with request.form(max_files=2, max_fields=8) as form:
        name, text, upload = form.get("name"), form.get("text", ""), form.get("file")
        name = _form_name(name)
        if not isinstance(text, str):
            raise APIError(400, "'text' (the sample's transcript) must be a text field, not a file", param="text")
        check_length(text, cfg.voices.max_text_chars, "text")
        if not isinstance(upload, UploadFile):
            raise APIError(400, "a voice sample needs its audio as a file part named 'file'", param="file")
        await _check_room(request, name)  # before the costly part: decoding and encoding the sample
        data = await upload.read()
    with st.limits.slot():  # the costly part is one of the server's requests in flight
        wav = await asyncio.to_thread(decode_upload, data, cfg.voices.max_upload_seconds, st.engine.sample_rate)
        try:
            codes = await st.engine.speaker_from_audio(wav)
        except ValueError as exc:  # a family without voice samples (ChatTTS's DVAE codes)
            raise APIError(400, str(exc), param="file") from None
    return await _add(request, name, sample_codes=codes, sample_text=text)


def _form_name(name) -> str:
    if not isinstance(name, str):
        raise APIError(400, "'name' must be a text field", param="name")
    try:
        return VoiceCreate(name=name).name
    except ValidationError as exc:
        raise _invalid(exc) from None


async def _check_room(request: Request, name: str) -> None:
    """Refuse early what ``_add`` would refuse anyway (which stays the authoritative check)."""
    voices, tenant, limit = request.app.state.voices, tenant_of(request.scope), _max_voices(request)
    if await _store(voices.get, name, tenant=tenant) is not None:
        raise APIError(409, f"voice {name!r} already exists", code="voice_exists")
    if await _store(voices.count, tenant=tenant) >= limit:
        raise APIError(409, limit_message(limit, tenant), code="voice_limit_reached")


def decode_upload(data: bytes, max_seconds: float, rate: int) -> np.ndarray:
    """An uploaded audio file -> mono float32 at ``rate`` (the model's) of at most ``max_seconds`` (blocking: call
    it in a worker thread). Decoding stops once that much audio is there: a small compressed file can claim
    hours (a 1 MiB FLAC of silence is hours of float32, gigabytes) and must not be expanded first."""
    import av

    limit = int(max_seconds * rate)
    try:
        # format_whitelist: ffmpeg refuses any other probed demuxer before it reads the header.
        with av.open(io.BytesIO(data), container_options={"format_whitelist": ",".join(AUDIO_DEMUXERS)}) as container:
            if not set(container.format.name.split(",")) & set(AUDIO_DEMUXERS):  # belt and braces
                raise ValueError(f"demuxer {container.format.name} is not allowed")
            wav = _decode_frames(container, container.streams.audio[0], limit, rate)
    except Exception:  # noqa: BLE001 - whatever ffmpeg cannot read is the client's problem
        logger.debug("voice upload refused: cannot decode", exc_info=True)
        raise APIError(400, UNREADABLE_AUDIO, param="file", code="invalid_audio") from None
    if len(wav) < int(MIN_UPLOAD_SECONDS * rate):
        raise APIError(400, "the uploaded audio is shorter than 0.25 s", param="file", code="invalid_audio")
    return wav


def _decode_frames(container, stream, limit: int, rate: int) -> np.ndarray:
    """Decode and resample frame by frame, stopping as soon as ``limit`` samples are there."""
    import av

    resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
    parts: list[np.ndarray] = []
    have = 0
    for frame in container.decode(stream):
        have += _collect(parts, resampler.resample(frame))
        if have >= limit:
            break
    else:
        _collect(parts, resampler.resample(None))  # the resampler's buffered tail
    wav = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    return wav[:limit]


def _collect(parts: list[np.ndarray], frames) -> int:
    got = 0
    for out in frames:
        samples = out.to_ndarray().reshape(-1)
        parts.append(samples)
        got += len(samples)
    return got
