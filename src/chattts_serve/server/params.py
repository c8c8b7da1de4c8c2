"""What a request asks for, as the engine takes it: its voice (a saved or built-in name, a speaker string,
or a blend of them: ``server.blend``) and its options on top of the server's defaults -> ``SamplingParams``;
its chunking -> ``StreamPolicy``. The same for every transport (HTTP routes, WebSocket, Wyoming). Bad
options are 400s here; speaker strings are checked later, when the engine prepares the request (a blend's
parts are checked here, when they are mixed).

Resolving a voice may read the voice store and mix a blend: the async callers run it in a worker thread
(``asyncio.to_thread``), never on the event loop."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from .. import models
from ..audio.encode import check_rate
from ..audio.policy import StreamPolicy
from ..audio.stretch import SpeedPlan, plan_speed
from ..models.family import ModelFamily, foreign_options
from ..sampling_params import SamplingParams, option_defaults
from ..text.lexicon import Lexicon, load_lexicon
from .auth import principal
from .blend import BlendError, is_blend, parse_blend, shown_term
from .errors import APIError, check_length, storage_error
from .protocol import ChatTTSOptions, StreamOptions, TTSRequest, parse_options
from .voices import VoiceStore, VoiceStoreError


@dataclass(frozen=True, slots=True)
class ResolvedVoice:
    """What a request's voice resolves to: the speaker and voice-sample fields of ``SamplingParams``.
    (``protocol.Voice`` is a saved voice as the API lists it.)"""

    speaker: str | None = None
    sample: str | None = None
    sample_text: str = ""


def tenant_of(scope) -> str | None:
    """Whose saved voices and cached results a request sees (``auth.Principal.owner``): its API key's tenant,
    or with plain ``--api-keys`` its key's own (all keys' one with ``--api-keys-shared``); None on a server
    without keys (the voices of no tenant)."""
    who = principal(scope)
    return who.owner if who is not None else None


def resolve_voice(
    store: VoiceStore,
    engine,
    name_or_speaker: str | None,
    default: str | None,
    param: str,
    tenant: str | None = None,
) -> ResolvedVoice:
    """A saved voice's name (``tenant``'s voices only: ``tenant_of``), a built-in (OpenAI) voice name, a
    speaker string, or a blend of them (``server.blend``: ``"a(2)+b(1)"``); anything else is a 400 (speaker
    strings are validated when the request is prepared, or here when they are blended)."""
    if name_or_speaker is None:
        if default is None:
            return ResolvedVoice()
        name_or_speaker = default
    if not is_blend(name_or_speaker):
        return _resolve_one(store, engine, name_or_speaker, param, tenant)
    try:
        terms = parse_blend(name_or_speaker)
    except BlendError as exc:
        raise APIError(400, str(exc), param=param, code="invalid_blend") from None
    if len(terms) == 1:  # "a(2)": one voice, whatever its weight (a voice sample included)
        return _resolve_one(store, engine, terms[0].voice, param, tenant)
    parts = [_blendable(store, engine, t.voice, param, tenant) for t in terms]
    try:
        return ResolvedVoice(speaker=engine.voices.blend(parts, [t.weight for t in terms]))
    except ValueError as exc:
        raise APIError(400, f"cannot blend these voices: {exc}", param=param, code="invalid_blend") from None


def _resolve_one(store: VoiceStore, engine, name_or_speaker: str, param: str, tenant: str | None) -> ResolvedVoice:
    try:
        rec = store.get(name_or_speaker, tenant=tenant)
    except VoiceStoreError as exc:
        raise storage_error(exc) from None
    if rec is not None:
        return ResolvedVoice(rec.speaker, rec.sample_codes, rec.sample_text or "")
    voices = engine.voices  # the model family's (``models.family.Voices``)
    if name_or_speaker in voices.builtin:
        # None on a checkpoint that has none to give (ChatTTS without speaker statistics): no voice
        return ResolvedVoice(speaker=voices.voice(name_or_speaker))
    if voices.is_voice(name_or_speaker):
        return ResolvedVoice(speaker=name_or_speaker)  # spelled as the family's voice string (checked later)
    raise APIError(
        400,
        f"unknown voice {shown_term(name_or_speaker)}: not a saved voice and not a speaker string",
        param=param,
        code="unknown_voice",
    )


def _blendable(store: VoiceStore, engine, voice: str, param: str, tenant: str | None) -> str:
    """One term of a blend: its voice string, checked. A voice sample (prompt codes, not an embedding) cannot be
    mixed, nor a built-in voice on a checkpoint without speaker statistics (it has no embedding)."""
    resolved = _resolve_one(store, engine, voice, param, tenant)
    if resolved.sample is not None:
        raise APIError(
            400,
            f"voice {voice!r} is a voice sample (a recording), not a speaker embedding: it cannot be blended",
            param=param,
            code="invalid_blend",
        )
    if resolved.speaker is None:
        raise APIError(
            400,
            f"voice {voice!r} has no speaker embedding on this model: it cannot be blended",
            param=param,
            code="invalid_blend",
        )
    try:
        engine.voices.check(resolved.speaker)
    except ValueError as exc:
        raise APIError(400, f"blend term {shown_term(voice)}: {exc}", param=param, code="invalid_blend") from None
    return resolved.speaker


def _given(**values):
    """The options a request set (None means: keep the default)."""
    return {k: v for k, v in values.items() if v is not None}


# The request fields that are sampling options (the same names as SamplingParams.from_options); the rest of
# ChatTTSOptions' fields are a family's own (``ModelFamily.owned_options``) and travel in ``options``.
_PARAMS_FIELDS = frozenset(option_defaults())
_SAMPLING_OPTIONS = tuple(
    name for name in ChatTTSOptions.model_fields if name in _PARAMS_FIELDS and name not in ("prompt", "lexicon")
)


@functools.lru_cache(maxsize=4)
def request_defaults(default_options: str) -> ChatTTSOptions | None:
    """``ServerConfig.default_options``, parsed once (validated when the config was made)."""
    return parse_options(default_options)


def build_params(
    opts: ChatTTSOptions,
    voice: ResolvedVoice,
    prompt: str | None = None,
    defaults: ChatTTSOptions | None = None,
    lexicon: str | None = None,
    max_text_chars: int | None = None,
    *,
    family: ModelFamily | None = None,
    model_speed: float = 1.0,
) -> SamplingParams:
    """A request's options on top of the server's ``defaults`` (``request_defaults``), on top of
    SamplingParams' own; ``prompt``: the prompt the request implies (an OpenAI ``speed`` other than 1),
    which wins over the defaults' but not over a prompt the request sets itself. ``lexicon``: the server's
    lexicon file (``ServerConfig.lexicon``), under the defaults' lexicon, under the request's.
    ``max_text_chars``: the server's ``max_input_chars``, which the engine holds the text to after every
    expansion too (``SamplingParams.max_text_chars``).

    ``family``: the served model's (``engine.family``). An option another family owns is a 400 naming it and
    its family (the server's defaults keep only the options this family takes). A family that does not take
    ChatTTS's prompt gets the implied speed as its own option instead (``model_speed``, ``SpeedPlan.model``),
    and its own request fields (``ModelFamily.owned_options`` that are not ``SamplingParams``': Kokoro's
    ``phonemes``, ``lang_code``; VITS's ``noise_scale``) in ``SamplingParams.options``, the defaults' under the
    request's. None: every option is taken (ChatTTS's rules)."""
    given_options = _given(**opts.model_dump())
    foreign: set[str] = set()
    own: dict = {}
    if family is not None:
        owners = models.option_owners()
        message = foreign_options(family.name, given_options, owners)
        if message is not None:
            name = next(n for n in given_options if owners.get(n, family.name) != family.name)
            raise APIError(400, message, param=name, code="unsupported_option")
        if family.name != "chattts":
            foreign = {n for n, owner in owners.items() if owner != family.name}
            prompt = None  # the speed goes to the family's own option
        # The family's own request fields that are not SamplingParams' (Kokoro's phonemes, VITS's noise scales)
        # travel in its options, the server's defaults for them under the request's.
        ours = {n for n, owner in owners.items() if owner == family.name and n not in _PARAMS_FIELDS}
        base = _given(**defaults.model_dump(include=ours)) if defaults is not None else {}
        own = base | {n: v for n, v in given_options.items() if n in ours}
    family_options = ({"speed": model_speed} if foreign and model_speed != 1.0 else {}) | own
    extra = {"options": family_options} if family_options else {}

    def given(name: str):
        value = getattr(opts, name)
        if value is None and defaults is not None and name not in foreign:
            return getattr(defaults, name)
        return value

    if opts.prompt is None and prompt is None and defaults is not None and "prompt" not in foreign:
        prompt = defaults.prompt
    try:
        words = Lexicon.layered(load_lexicon(lexicon), defaults.lexicon if defaults is not None else None)
        return SamplingParams.from_options(
            **{name: given(name) for name in _SAMPLING_OPTIONS},
            lexicon=Lexicon.layered(words, opts.lexicon),
            prompt=opts.prompt if opts.prompt is not None else prompt,
            speaker=voice.speaker,
            speaker_sample=voice.sample,
            speaker_sample_text=voice.sample_text,
            max_text_chars=max_text_chars,
            **extra,
        )
    except ValueError as exc:
        raise APIError(400, str(exc)) from None


def output_rate(engine, fmt: str, sample_rate: int | None) -> int:
    """The rate ``fmt`` is sent at for a request's ``sample_rate`` (None: the format's default) from the model's
    audio (``engine.sample_rate``); a 400 naming ``sample_rate`` when the format cannot have it."""
    try:
        return check_rate(fmt, sample_rate, engine.sample_rate)
    except ValueError as exc:
        raise APIError(400, f"sample_rate: {exc}", param="sample_rate", code="invalid_request") from None


def server_params(state, opts: ChatTTSOptions, voice: ResolvedVoice, speed: SpeedPlan | None = None) -> SamplingParams:
    """``build_params`` with what the server decides for every route: its default options, its lexicon, its
    input bound and the served family, read from ``state`` (the app's state: config and engine); ``speed``: the
    request's ``plan_speed`` (None: no speed of its own)."""
    cfg = state.config
    return build_params(
        opts,
        voice,
        prompt=None if speed is None else speed.prompt,
        defaults=request_defaults(cfg.default_options),
        lexicon=cfg.lexicon,
        max_text_chars=cfg.max_input_chars,
        family=state.engine.family,
        model_speed=1.0 if speed is None else speed.model,
    )


def build_policy(default: StreamPolicy, opts: StreamOptions | None) -> StreamPolicy:
    if opts is None:
        return default
    changes = _given(**opts.model_dump())
    try:
        return replace(default, **changes)
    except ValueError as exc:
        raise APIError(400, str(exc), param="chunking") from None


def tts_params(
    state, body: TTSRequest, tenant: str | None, rates_stretched: bool = False
) -> tuple[SamplingParams, StreamPolicy, float]:
    """A native request (``/v1/tts``, ``/v1/tts/captioned``, the WebSocket's start message) as what the engine
    and the response need: its ``SamplingParams``, its chunking policy and its time-stretch factor (1: none).
    ``state``: the app's state (config, voices, engine). ``rates_stretched``: the response's encoder stretches
    each SSML rate run by its rate (``speed_mode`` "stretch" or "both" on ``/v1/tts``); elsewhere a rate stays a
    ``[speed_N]``, as the sentence timings those routes give are counted in the model's samples."""
    cfg = state.config
    check_length(body.text, cfg.max_input_chars, "text")
    voice = resolve_voice(state.voices, state.engine, body.speaker or body.voice, cfg.voices.default, "voice", tenant)
    speed = plan_speed(body.speed, body.speed_mode)
    params = server_params(state, body, voice, speed)
    if rates_stretched and body.speed_mode != "prompt":
        params = replace(params, speed_mode=body.speed_mode, stretch=speed.stretch)
    return params, build_policy(state.engine.stream_policy, body.chunking), speed.stretch
