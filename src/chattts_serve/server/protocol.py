"""Request and response schemas of the HTTP API (the package's only pydantic)."""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from .. import models
from ..audio.resample import MAX_RATE, MIN_RATE
from ..audio.stretch import MAX_SPEED, MIN_SPEED, SpeedMode
from ..models.family import OptionSpec
from ..sampling_params import OPTION_BOUNDS as _B
from ..sampling_params import option_defaults

AudioFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm", "mulaw", "alaw"]  # audio.encode.FORMATS
MEDIA_TYPES: dict[str, str] = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "mulaw": "audio/PCMU",  # G.711 without a header (RFC 3551's names; 8 kHz unless sample_rate says otherwise)
    "alaw": "audio/PCMA",
}
SAMPLE_RATE_FIELD = Field(
    None,
    ge=MIN_RATE,
    le=MAX_RATE,
    description="Output sample rate in Hz for pcm, wav, flac, mulaw and alaw (default: 8000 for mulaw and alaw, "
    "else the model's: 24000 for ChatTTS); mp3, opus and aac are always at the model's rate.",
)
"""Whether the format takes the rate depends on the model's rate: the routes check it (``params.output_rate``)."""


SPEED_FIELD = Field(1.0, ge=MIN_SPEED, le=MAX_SPEED)


def _unstretched(v, speed: float, speed_mode: str, name: str):
    """``v`` when the audio is not time-stretched: sentence timings are counted in the model's samples, and a
    stretched stream's would be estimates."""
    if v and speed_mode != "prompt" and speed != 1.0:
        raise PydanticCustomError(name, f'{name} need speed_mode "prompt" (timings of stretched audio are not exact)')
    return v


VOICE_CHARS = 8192
"""Longest voice or speaker field: a blend of 8 speaker strings (~870 characters each) with weights."""


class _Strict(BaseModel):
    # strict: no silent coercion (true is not a seed, "2" is not a speed); unknown fields are errors.
    model_config = ConfigDict(extra="forbid", strict=True)


def _finite(v: float | None) -> float | None:
    if v is not None and not math.isfinite(v):
        raise ValueError("must be a finite number")
    return v


class _SamplingOptions(_Strict):
    """The ``SamplingParams`` fields a request sets (ChatTTS's sampling and text options); every field is optional
    (None: the engine's default, in ``SamplingParams``). Names and bounds are ``sampling_params``'
    (``OPTION_BOUNDS``)."""

    seed: int | None = Field(None, **_B["seed"])
    temperature: float | None = Field(None, **_B["temperature"])
    top_p: float | None = Field(None, **_B["top_p"])
    top_k: int | None = Field(None, **_B["top_k"])
    repetition_penalty: float | None = Field(None, **_B["repetition_penalty"])
    min_new_tokens: int | None = Field(None, **_B["min_new_tokens"])
    max_new_tokens: int | None = Field(None, **_B["max_new_tokens"])
    prompt: str | None = Field(None, **_B["prompt"])
    refine_text: bool | None = None
    refine_prompt: str | None = Field(None, **_B["refine_prompt"])
    refine_temperature: float | None = Field(None, **_B["refine_temperature"])
    refine_top_p: float | None = Field(None, **_B["refine_top_p"])
    refine_top_k: int | None = Field(None, **_B["refine_top_k"])
    refine_repetition_penalty: float | None = Field(None, **_B["refine_repetition_penalty"])
    refine_min_new_tokens: int | None = Field(None, **_B["refine_min_new_tokens"])
    refine_max_new_tokens: int | None = Field(None, **_B["refine_max_new_tokens"])
    refine_seed: int | None = Field(None, **_B["refine_seed"])
    """The refine pass's own seed (None: the request's ``seed``)."""
    do_text_normalization: bool | None = None
    do_homophone_replacement: bool | None = None
    lang: Literal["zh", "en"] | None = None  # sampling_params.LANGS
    text_cleanup: Literal["none", "markdown"] | None = None  # text.cleanup.TEXT_CLEANUPS
    """"markdown": speak markdown (LLM output) as a person reads it: link text, no marks, URLs as hosts."""
    lexicon: dict[str, str] | None = Field(None, max_length=1000)  # word -> text or pinyin "chang2" (text/lexicon.py)
    split_text: bool | None = None
    first_sentence_voice: bool | None = None
    """With split text: speak the first sentence first and take every sentence's voice from it."""

    @field_validator(
        "temperature", "top_p", "repetition_penalty", "refine_temperature", "refine_top_p", "refine_repetition_penalty"
    )
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        return _finite(v)


def _field(spec: OptionSpec, family: str) -> tuple[Any, Any]:
    """A family's own request field (``OptionSpec``: its kind, bounds and length) as a pydantic field; optional
    (None: the family's default)."""
    doc = f"{family}: {spec.help or spec.label}"
    if spec.kind in ("number", "integer"):
        kind = float if spec.kind == "number" else int
        return kind | None, Field(None, ge=spec.minimum, le=spec.maximum, description=doc)
    if spec.kind == "boolean":
        return bool | None, Field(None, description=doc)
    return str | None, Field(None, min_length=1, max_length=spec.max_length, description=doc)


def _family_fields() -> tuple[dict[str, tuple[Any, Any]], tuple[str, ...]]:
    """Every family's own request fields that are not ``SamplingParams``' (Kokoro's ``phonemes`` and ``lang_code``,
    VITS's noise scales), from each family's ``request_options()``, and the names of those that are numbers. An
    option another family owns is still a field here: the route refuses it by name (``params.build_params``)."""
    sampling = set(option_defaults())
    fields: dict[str, tuple[Any, Any]] = {}
    numbers: list[str] = []
    for family in models.families():
        for spec in family.request_options():
            if spec.name in family.owned_options and spec.name not in sampling and spec.name not in fields:
                fields[spec.name] = _field(spec, family.name)
                numbers += [spec.name] if spec.kind == "number" else []
    return fields, tuple(numbers)


_FAMILY_FIELDS, _FAMILY_NUMBERS = _family_fields()
ChatTTSOptions = create_model(
    "ChatTTSOptions",
    __base__=_SamplingOptions,
    __doc__="A request's model options (the ``chattts`` object; the flat fields of ``/v1/tts``): the sampling "
    "options, then every family's own (built from the registry at import: a family adds its fields from its own "
    "package). Every field is optional; an option another family owns is refused by name.",
    __validators__={"_family_finite": field_validator(*_FAMILY_NUMBERS)(lambda cls, v: _finite(v))}
    if _FAMILY_NUMBERS
    else None,
    **_FAMILY_FIELDS,
)


def parse_options(text: str) -> ChatTTSOptions | None:
    """A JSON object of ChatTTS options (``ServerConfig.default_options``), validated; None when empty.
    Raises ValueError naming what is wrong."""
    if not text.strip():
        return None
    try:
        raw = json.loads(text)
    except ValueError:
        raise ValueError(f"default_options is not JSON: {text[:100]!r}") from None
    if not isinstance(raw, dict):
        raise ValueError('default_options must be a JSON object, e.g. {"refine_text": false, "seed": 7}')
    try:
        return ChatTTSOptions(**raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ())) or "options"
        raise ValueError(f"default_options: {where}: {first['msg']}") from None


class SpeechRequest(ChatTTSOptions):
    """OpenAI ``POST /v1/audio/speech``, plus the ChatTTS options as optional extensions."""

    model: str = Field(..., min_length=1, max_length=128)
    input: str = Field(..., min_length=1)
    voice: str = Field(..., min_length=1, max_length=VOICE_CHARS)
    """A saved voice's name, one of OpenAI's voice names, a speaker string, or a blend of up to 8 of them
    (``"alloy(2)+nova(1)"``, server/blend.py)."""
    instructions: str | None = Field(None, max_length=4096)
    """Accepted for compatibility; ChatTTS has no instruction conditioning (ignored)."""
    response_format: AudioFormat = "mp3"
    speed: float = SPEED_FIELD
    """How ``speed_mode`` says: ChatTTS's [speed_0]..[speed_9] (1.0 -> [speed_5]) and/or a time stretch."""
    speed_mode: SpeedMode = "prompt"
    """Not OpenAI's (``extra_body``): "prompt", "stretch" or "both" (``audio.stretch``)."""
    stream_format: Literal["audio", "sse"] = "audio"
    sample_rate: int | None = SAMPLE_RATE_FIELD
    """Not OpenAI's: the ``openai`` SDK sends it in ``extra_body``."""
    timestamps: bool = False
    """Not OpenAI's: with ``stream_format`` "sse", a ``speech.segment`` event as each sentence's audio is done."""

    @field_validator("timestamps")
    @classmethod
    def _timestamps_in_sse(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("stream_format") != "sse":
            raise PydanticCustomError("timestamps", 'timestamps are events: they need stream_format "sse"')
        return _unstretched(v, info.data.get("speed", 1.0), info.data.get("speed_mode", "prompt"), "timestamps")


class StreamOptions(_Strict):
    first_chunk: int | None = Field(None, ge=1, le=4096)
    max_chunk: int | None = Field(None, ge=1, le=4096)
    left_context: int | None = Field(None, ge=0, le=256)
    lookahead: int | None = Field(None, ge=1, le=256)
    crossfade: int | None = Field(None, ge=0, le=65536)


class TTSRequest(ChatTTSOptions):
    """Native ``POST /v1/tts``: every ChatTTS parameter; streams by default."""

    text: str = Field(..., min_length=1)
    voice: str | None = Field(None, max_length=VOICE_CHARS)
    """A saved voice's name, a speaker string, or a blend (``"alloy(2)+nova(1)"``)."""
    speaker: str | None = Field(None, max_length=VOICE_CHARS)
    """A speaker string or a blend (wins over ``voice``)."""
    format: AudioFormat = "wav"
    sample_rate: int | None = SAMPLE_RATE_FIELD
    speed: float = SPEED_FIELD
    """1 = normal; applied as ``speed_mode`` says (a ``prompt`` the request sets wins over "prompt"'s)."""
    speed_mode: SpeedMode = "prompt"
    """"prompt" (ChatTTS's [speed_N]), "stretch" (a pitch-preserving time stretch) or "both" (``audio.stretch``)."""
    stream: bool = True
    chunking: StreamOptions | None = None


MAX_TURNS = 32
"""Most turns in one dialogue: each is an engine request, all submitted at once."""


class DialogueTurn(ChatTTSOptions):
    """One turn of ``POST /v1/dialogue``: its text, its voice and its own ChatTTS options."""

    text: str = Field(..., min_length=1)
    voice: str | None = Field(None, max_length=VOICE_CHARS)
    """As ``TTSRequest.voice``: a saved voice, an OpenAI voice name, a speaker string, or a blend."""
    speaker: str | None = Field(None, max_length=VOICE_CHARS)
    """A speaker string or a blend (wins over ``voice``)."""


class DialogueRequest(_Strict):
    """Native ``POST /v1/dialogue``: the turns spoken in order as one audio stream, each in its voice; streams
    by default."""

    turns: list[DialogueTurn] = Field(..., min_length=1, max_length=MAX_TURNS)
    format: AudioFormat = "wav"
    sample_rate: int | None = SAMPLE_RATE_FIELD
    stream: bool = True
    pause_ms: int = Field(300, ge=0, le=5000)
    """Silence between two turns."""
    chunking: StreamOptions | None = None


CaptionFormat = Literal["srt", "vtt"]  # server.captions.CAPTION_MEDIA_TYPES


class CaptionedRequest(TTSRequest):
    """``POST /v1/tts/captioned``: as ``POST /v1/tts``, answered with one JSON document (the audio and each
    sentence's timing), or with subtitles only when ``format`` is srt or vtt."""

    format: AudioFormat | CaptionFormat = "wav"
    stream: Literal[False] = False
    captions: CaptionFormat | None = None
    """Subtitles in the JSON too, in this format."""
    caption_unit: Literal["sentence", "word"] = "sentence"
    """The subtitles' cues: one per sentence, or one per word (a model with word timestamps: Kokoro)."""

    @model_validator(mode="after")
    def _timed(self) -> CaptionedRequest:
        _unstretched(True, self.speed, self.speed_mode, "captions")
        return self


class WordTime(BaseModel):
    """One word's place in the audio, as Kokoro-FastAPI's captioned speech gives it (exact: counted from the
    durations the model predicted, not estimated)."""

    word: str
    start_time: float
    end_time: float


class Segment(BaseModel):
    """One sentence's place in the audio (exact: counted in samples, not estimated)."""

    index: int
    text: str
    """As normalised, without control tokens."""
    start_s: float
    end_s: float
    words: list[WordTime] | None = None
    """Its words' places: only from a model with word timestamps (``/v1/models``' ``capabilities.timestamps``)."""

    @model_serializer(mode="wrap")
    def _words_only_when_timed(self, handler):
        data = handler(self)
        if self.words is None:  # a sentence-timed model's segments stay as they always were
            data.pop("words", None)
        return data


class CaptionedSpeech(BaseModel):
    audio: str
    """The audio in ``format``, base64."""
    format: AudioFormat
    sample_rate: int
    duration_s: float
    segments: list[Segment]
    captions: str | None = None


class VoiceCreate(_Strict):
    # Names are plain ASCII (no Unicode look-alike of another voice's name) and never ".", ".." or a
    # hidden-file name, so they are safe in URLs, logs and file names. pydantic matches with Rust's
    # regex, where "$" is the very end (a trailing newline does not match).
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*$")
    speaker: str | None = Field(None, max_length=VOICE_CHARS)
    """A speaker string, or a blend saved as the speaker it mixes now."""
    seed: int | None = Field(None, ge=0, lt=2**63)
    description: str | None = Field(None, max_length=512)


class Voice(BaseModel):
    name: str
    kind: Literal["speaker", "sample"]
    speaker: str | None = None
    sample_text: str | None = None
    description: str | None = None
    created_at: float


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "chattts-serve"
    family: str | None = None
    """Not OpenAI's: the served model's family (``chattts``, ``kokoro``, ...)."""
    sample_rate: int | None = None
    """Not OpenAI's: the rate of the model's audio in Hz (the default of pcm, wav and flac)."""
    capabilities: dict[str, str | bool] | None = None
    """Not OpenAI's: what the family can do (``models.family.Capabilities``): ``streaming`` ("window" or
    "sentence"), ``timestamps`` ("sentence" or "word"), ``refine``, ``control_tokens``."""
    voices: list[dict[str, str]] | None = None
    """Not OpenAI's: the model's built-in voices, each ``{"name", "description"}`` (saved ones: ``/v1/voices``)."""
    options: list[dict[str, Any]] | None = None
    """Not OpenAI's: the request options the family reads beyond text, voice and seed, each as
    ``models.family.OptionSpec`` (name, kind, label, default, minimum, maximum, step, choices, help)."""
    sample_text: str | None = None
    """Not OpenAI's: a sentence in the model's language, for a first try."""


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
