"""Per-request parameters. Defaults are the reference's (``InferCodeParams`` / ``RefineTextParams``).

The flat options (``SamplingParams.from_options``'s names: every field, and the refine pass's as
``refine_<field>``) have their defaults here, in the dataclasses, and the bounds a request or a command
line may ask for in ``OPTION_BOUNDS``; the HTTP schema (``server.protocol.ChatTTSOptions``) and the CLI
flags (``add_sampling_arguments``) both read them from here.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from .models.chattts.config import NUM_VQ
from .text.cleanup import TEXT_CLEANUPS

LANGS = ("zh", "en")
"""``SamplingParams.lang``'s values (None: detect)."""
SPEED_MODES = ("prompt", "stretch", "both")
"""``SamplingParams.speed_mode``'s values (``audio.stretch.SPEED_MODES``)."""


def _check_common(owner: str, p) -> None:
    temps = p.temperature if isinstance(p.temperature, tuple) else (p.temperature,)
    for t in temps:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"{owner}.temperature must be a finite number > 0, got {p.temperature!r}")
    if isinstance(p.top_p, bool) or not isinstance(p.top_p, (int, float)) or not 0 < p.top_p <= 1:
        raise ValueError(f"{owner}.top_p must be in (0, 1], got {p.top_p!r}")
    if isinstance(p.top_k, bool) or not isinstance(p.top_k, int) or p.top_k < 0:
        raise ValueError(f"{owner}.top_k must be an int >= 0 (0 disables it), got {p.top_k!r}")
    rp = p.repetition_penalty
    if isinstance(rp, bool) or not isinstance(rp, (int, float)) or not math.isfinite(rp) or rp <= 0:
        raise ValueError(f"{owner}.repetition_penalty must be a finite number > 0, got {rp!r}")
    for name in ("min_new_tokens", "max_new_tokens"):
        v = getattr(p, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{owner}.{name} must be an int >= 0, got {v!r}")
    if p.max_new_tokens < 1:
        raise ValueError(f"{owner}.max_new_tokens must be >= 1, got {p.max_new_tokens}")
    if p.min_new_tokens > p.max_new_tokens:
        raise ValueError(
            f"{owner}.min_new_tokens ({p.min_new_tokens}) must not exceed max_new_tokens ({p.max_new_tokens})"
        )
    if p.seed is not None and (isinstance(p.seed, bool) or not isinstance(p.seed, int) or not 0 <= p.seed < 2**63):
        raise ValueError(f"{owner}.seed must be an int in [0, 2**63) or None, got {p.seed!r}")
    if not isinstance(p.prompt, str):
        raise ValueError(f"{owner}.prompt must be a string, got {type(p.prompt).__name__}")


def speed_prompt(speed: float) -> str:
    """A speaking rate (1 = normal; OpenAI's ``speed`` 0.25..4, SSML's ``<prosody rate>``) as ChatTTS's
    ``[speed_0]``..``[speed_9]`` prompt: 1 -> 5, each doubling +2.5, rounded half to even and clamped."""
    return f"[speed_{min(9, max(0, round(5 + 2.5 * math.log2(speed))))}]"


@dataclass(frozen=True, slots=True)
class RefineParams:
    """The refine_text pass (text head): rewrites the text with prosody tokens before speech."""

    prompt: str = ""
    """Appended after [Pbreak], e.g. "[oral_2][laugh_0][break_6]"."""
    temperature: float = 0.7
    top_p: float = 0.7
    top_k: int = 20
    repetition_penalty: float = 1.0
    """The reference's text-pass penalty is broken for values != 1; ours applies it correctly."""
    min_new_tokens: int = 0
    max_new_tokens: int = 384
    seed: int | None = None
    """None: use the request's seed."""

    def __post_init__(self) -> None:
        _check_common("refine", self)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Everything that shapes one utterance. Frozen: safe to share between requests.

    One class for every model family, so that the public API stays what ChatTTS users have always called
    (``SamplingParams(seed=7, speaker=...)``, every CLI flag and HTTP option, the result cache's keys). Its
    fields are of two kinds: the common part, which every family reads (``seed``, ``speaker``: the family's
    voice string, ``lang``, ``text_cleanup``, ``lexicon``, ``split_text``, ``do_text_normalization``,
    ``max_text_chars``), and
    the fields one family owns (ChatTTS's sampler, prompt, refine pass, voice step and voice sample:
    ``models.chattts.family.OWNED_OPTIONS``), which another family refuses by name
    (``FamilyModel.check_options``). A family's options that ChatTTS does not have travel in ``options``."""

    seed: int | None = None
    """With a seed the sampler's generator is re-seeded with it before every step (the reference's
    ``manual_seed`` semantics), so the same seed, text and speaker give the same codes. None: random."""
    temperature: float | tuple[float, ...] = 0.3
    """Audio-code temperature; one value, or one per codebook (4)."""
    top_p: float = 0.7
    top_k: int = 20
    repetition_penalty: float = 1.05
    """Applied per codebook over the last 16 generated codes."""
    min_new_tokens: int = 0
    max_new_tokens: int = 2048
    """Per text segment; 1 token = 4 codes = 512 samples (46.875 tokens per second of audio)."""
    speaker: str | None = None
    """A speaker string (``chattts-serve speaker new``); None = no speaker embedding ([empty_spk])."""
    prompt: str = "[speed_5]"
    """Prepended to the text of the audio pass; [speed_0]..[speed_9]."""
    speaker_sample: str | None = None
    """Zero-shot voice prompt: a prompt-codes string (``Engine.speaker_from_audio``) of a recording."""
    speaker_sample_text: str = ""
    """The transcript of ``speaker_sample`` (placed before the text, as the reference's txt_smp)."""
    refine_text: bool = True
    refine: RefineParams = field(default_factory=RefineParams)
    do_text_normalization: bool = True
    do_homophone_replacement: bool = True
    lang: str | None = None
    """"zh", "en" or None (detect)."""
    text_cleanup: str = "none"
    """"markdown": speak markdown (LLM output, READMEs) as a person reads it: link text without its target,
    no emphasis, code, heading or bullet marks, a bare URL as its host, no emoji (``text/cleanup.py``).
    "none" (the default, as the reference): the text as given."""
    lexicon: Any = None  # word -> text or pinyin ("chang2"), before normalisation: text/lexicon.py's Lexicon or a dict
    split_text: bool = True
    """Split long text into sentences, generate each, and join the audio (as the reference)."""
    first_sentence_voice: bool = True
    """With split text of several sentences and no ``speaker_sample``: generate the first sentence
    alone, encode its audio into a voice sample, and speak every sentence (the first included) with
    that sample and the first sentence as its transcript, so timbre and prosody stay the same across
    sentences. This is the reference's behaviour; it costs one extra sentence of generation (and the
    first streamed chunk waits for it). False: every sentence uses only the speaker embedding."""
    ensure_non_empty: bool = True
    """Unseeded requests whose first step is EOS are generated again (as the reference)."""
    max_text_chars: int = 20_000
    """The most characters the text may have, as given and after every expansion (the lexicon, SSML's
    ``<sub>`` and ``<say-as>``, markdown cleanup, normalisation): the input processor counts as it expands
    and refuses the request (``text.bound.TextTooLong``) as soon as the text passes it. The server sets its
    ``max_input_chars`` here."""
    speed_mode: str = "prompt"
    """How SSML's ``<prosody rate>`` is had (the server's ``speed_mode``, ``audio.stretch``): "prompt" (the
    default) each rate run's ``[speed_N]``; "stretch" each rate run's audio time-stretched by its rate instead,
    by the server's encoder (``PreparedRequest.stretches``); "both" the two. The offline API stretches nothing."""
    stretch: float = 1.0
    """The response's own time-stretch factor (``SpeedPlan.stretch``), which a run without a rate keeps: with
    ``speed_mode`` "stretch" or "both", a run's rate stands in for it, as its ``[speed_N]`` stands in for the
    request's prompt."""
    options: Any = None
    """A model family's own options by name (a mapping, e.g. Kokoro's ``{"speed": 1.2}``), validated by the
    family (``FamilyModel.check_options``); None: its defaults. ChatTTS has none."""

    def __post_init__(self) -> None:
        if isinstance(self.temperature, list):
            object.__setattr__(self, "temperature", tuple(self.temperature))
        if isinstance(self.temperature, tuple) and len(self.temperature) != NUM_VQ:
            raise ValueError(f"temperature must be one number or {NUM_VQ}, got {len(self.temperature)} values")
        _check_common("params", self)
        if self.speaker is not None and not isinstance(self.speaker, str):
            raise ValueError(f"speaker must be a speaker string or None, got {type(self.speaker).__name__}")
        if self.speaker_sample is not None and not isinstance(self.speaker_sample, str):
            raise ValueError("speaker_sample must be a prompt-codes string or None")
        if not isinstance(self.speaker_sample_text, str):
            raise ValueError("speaker_sample_text must be a string")
        if self.text_cleanup not in TEXT_CLEANUPS:
            raise ValueError(f"text_cleanup must be one of {', '.join(TEXT_CLEANUPS)}, got {self.text_cleanup!r}")
        if self.lang is not None and self.lang not in LANGS:
            raise ValueError(f"lang must be 'zh', 'en' or None, got {self.lang!r}")
        if isinstance(self.max_text_chars, bool) or not isinstance(self.max_text_chars, int) or self.max_text_chars < 1:
            raise ValueError(f"max_text_chars must be an int >= 1, got {self.max_text_chars!r}")
        if self.speed_mode not in SPEED_MODES:
            raise ValueError(f"speed_mode must be one of {', '.join(SPEED_MODES)}, got {self.speed_mode!r}")
        if isinstance(self.stretch, bool) or not isinstance(self.stretch, int | float) or not 0.25 <= self.stretch <= 4:
            raise ValueError(f"stretch must be a number between 0.25 and 4, got {self.stretch!r}")
        if not isinstance(self.refine, RefineParams):
            raise ValueError(f"refine must be RefineParams, got {type(self.refine).__name__}")
        if self.options is not None and not isinstance(self.options, Mapping):
            raise ValueError(
                f"options must be a mapping of a model family's options, got {type(self.options).__name__}"
            )

    @property
    def temperatures(self) -> tuple[float, ...]:
        t = self.temperature
        return t if isinstance(t, tuple) else (float(t),) * NUM_VQ

    @property
    def refine_seed(self) -> int | None:
        return self.refine.seed if self.refine.seed is not None else self.seed

    @classmethod
    def from_options(cls, base: SamplingParams | None = None, **options: Any) -> SamplingParams:
        """``base`` (default: the defaults) with flat options set, as the HTTP API and the CLI name
        them: every field by its name, and the refine pass's as ``refine_<field>``. None keeps the
        value. Raises ValueError for an unknown name or a bad value."""
        base = base or cls()
        own = {f.name for f in fields(cls)} - {"refine"}
        refine_names = {f"refine_{f.name}": f.name for f in fields(RefineParams)}
        unknown = set(options) - own - set(refine_names)
        if unknown:
            raise ValueError(f"unknown sampling option(s): {', '.join(sorted(unknown))}")
        given = {k: v for k, v in options.items() if v is not None}
        refine = {refine_names[k]: v for k, v in given.items() if k in refine_names}
        top = {k: v for k, v in given.items() if k in own}
        return replace(base, **top, refine=replace(base.refine, **refine))


def option_defaults() -> dict[str, Any]:
    """Each flat option (``SamplingParams.from_options``'s names) and its default."""
    return flat_options(SamplingParams())


def flat_options(params: SamplingParams) -> dict[str, Any]:
    """``params`` as flat options (``SamplingParams.from_options``'s names)."""
    out = {f.name: getattr(params, f.name) for f in fields(SamplingParams) if f.name != "refine"}
    return out | {f"refine_{f.name}": getattr(params.refine, f.name) for f in fields(RefineParams)}


OPTION_BOUNDS: dict[str, dict[str, float]] = {
    "seed": {"ge": 0, "lt": 2**63},
    "temperature": {"gt": 0, "le": 5},
    "top_p": {"gt": 0, "le": 1},
    "top_k": {"ge": 0, "le": 1000},
    "repetition_penalty": {"gt": 0, "le": 10},
    "min_new_tokens": {"ge": 0, "le": 4096},
    "max_new_tokens": {"ge": 1, "le": 4096},
    "prompt": {"max_length": 256},
    "refine_prompt": {"max_length": 256},
    "refine_temperature": {"gt": 0, "le": 5},
    "refine_top_p": {"gt": 0, "le": 1},
    "refine_top_k": {"ge": 0, "le": 1000},
    "refine_repetition_penalty": {"gt": 0, "le": 10},
    "refine_min_new_tokens": {"ge": 0, "le": 2048},
    "refine_max_new_tokens": {"ge": 1, "le": 2048},
    "refine_seed": {"ge": 0, "lt": 2**63},
}
"""What a request (HTTP, WebSocket, Wyoming) or a command line may ask for, in pydantic's ``Field`` terms.
Tighter than the dataclasses' own checks (which take any meaningful value): these also cap what one
request may cost."""

# ---------------------------------------------------------------------------------------------------
# CLI flags. Booleans that default to on are turned off by the command line's established spellings.

_OFF_FLAGS = {
    "refine_text": ("--no-refine", "skip the refine pass"),
    "do_text_normalization": ("--no-normalize", "skip text normalisation"),
    "do_homophone_replacement": ("--no-homophone-replacement", "keep homophones the tokenizer lacks as they are"),
    "split_text": ("--no-split", "do not split long text into sentences"),
    "first_sentence_voice": (
        "--no-first-sentence-voice",
        "with split text, do not speak the first sentence first to take every sentence's voice from it "
        "(the reference's way of keeping one voice; costs one extra sentence of generation)",
    ),
}
_CLI_HELP = {
    "seed": "re-seed the sampler with it before every step: the same seed, text and speaker give the same "
    "audio (default: random)",
    "speaker": "speaker string (see `speaker new`)",
    "prompt": "audio prompt, e.g. [speed_3]",
    "lang": "text language, zh or en (default: detected)",
    "text_cleanup": "markdown: speak markdown as a person reads it (link text, no marks, URLs as hosts, no emoji)",
    "refine_prompt": "refine-pass prompt, e.g. [oral_2][laugh_0][break_6]",
    "refine_seed": "refine-pass seed (default: --seed)",
}
_NONE_TYPES = {"seed": int, "refine_seed": int, "speaker": str, "lang": str}
SAMPLING_FLAGS: tuple[str, ...] = (
    *("seed", "speaker", "temperature", "top_p", "top_k", "repetition_penalty", "min_new_tokens"),
    *("max_new_tokens", "prompt", "lang", "text_cleanup", "refine_text", "refine_prompt", "refine_temperature"),
    *("refine_top_p",),
    *("refine_top_k", "refine_repetition_penalty", "refine_min_new_tokens", "refine_max_new_tokens"),
    *("refine_seed", "do_text_normalization", "do_homophone_replacement", "split_text", "first_sentence_voice"),
)
"""The flat options the CLI takes (``add_sampling_arguments``); the voice-sample fields are the API's."""


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per ``SAMPLING_FLAGS`` option, bounded by ``OPTION_BOUNDS``; defaults None (then
    ``from_options`` keeps the dataclass default, shown in the help)."""
    defaults = option_defaults()
    for name in SAMPLING_FLAGS:
        default = defaults[name]
        if name in _OFF_FLAGS:
            flag, help_ = _OFF_FLAGS[name]
            p.add_argument(flag, dest=name, action="store_false", default=None, help=help_)
            continue
        kind = _NONE_TYPES.get(name) or type(default)
        shown = _CLI_HELP.get(name, "") if default is None else f"{_CLI_HELP.get(name, '')} (default: {default!r})"
        choices = {"lang": LANGS, "text_cleanup": TEXT_CLEANUPS}.get(name)
        flag = "--" + name.replace("_", "-")
        p.add_argument(flag, dest=name, type=_bounded(name, kind), choices=choices, default=None, help=shown.strip())


def bounds_error(name: str, value: Any) -> str | None:
    """What is wrong with ``value`` under ``OPTION_BOUNDS[name]``; None when it is within them."""
    b = OPTION_BOUNDS.get(name, {})
    if "max_length" in b:
        return f"at most {b['max_length']} characters" if len(value) > b["max_length"] else None
    if isinstance(value, float) and not math.isfinite(value):
        return "must be a finite number"
    ok = (
        ("gt" not in b or value > b["gt"])
        and ("ge" not in b or value >= b["ge"])
        and ("lt" not in b or value < b["lt"])
        and ("le" not in b or value <= b["le"])
    )
    if ok:
        return None
    words = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    return "must be " + " and ".join(f"{words[k]} {v}" for k, v in b.items())


def _bounded(name: str, kind: type):
    def parse(raw: str):
        try:
            value = kind(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {raw!r}") from None
        problem = bounds_error(name, value)
        if problem:
            raise argparse.ArgumentTypeError(f"{problem}, got {raw!r}")
        return value

    return parse


assert set(OPTION_BOUNDS) <= set(option_defaults()) and set(SAMPLING_FLAGS) <= set(option_defaults())
