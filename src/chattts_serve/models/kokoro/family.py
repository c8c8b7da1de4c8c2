"""Kokoro-82M as a model family: a "batch" family on the seam (``models.family``).

What a request becomes: its text -> misaki's G2P (``text.G2P``: the voice's language) -> sentences of at most
510 phonemes (``sentences.sentence_chunks``) -> one ``Utterance`` each (work = its input ids), styled by its
voice pack's row for its phoneme count, with its own noise seed (the request's seed and the sentence's index).
The engine batches utterances across requests (``engine.batch.BatchStage``) and ``KokoroModel.synthesize`` runs
each batch in one forward; every sentence's words get their times from the durations the model predicted
(``text.word_timestamps``), counted, not estimated.

Voices are the checkpoint's packs by name (``af_heart``, ``zf_xiaobei``, ...). A voice string is a pack name or
a blend in Kokoro-FastAPI's syntax with normalised weights (``af_bella(0.666667)+af_sky(0.333333)``): the
weighted mean of the packs. Five OpenAI voice names have namesake packs in Kokoro v1.0 (``alloy`` ->
``af_alloy``, ``echo``, ``fable``, ``nova``, ``onyx``) and are built-in aliases for them where the checkpoint
has them; OpenAI's other names are unknown voices (a 400: none is silently given another voice).

Its options (``SamplingParams.options``): ``speed`` (Kokoro's own duration scale; OpenAI's ``speed`` maps to it),
``phonemes`` (speak these phonemes exactly, one utterance) and ``lang_code`` (Kokoro-FastAPI's name: the G2P's
language, ``a`` American English, ``b`` British English, ``z`` Mandarin; default: the voice's first letter, as
the package picks it). The common ``lang`` ("zh", "en") picks the language too. ChatTTS's options are refused
by name (``models.check_foreign``).

torch, the model and misaki are imported when a checkpoint is loaded: the registry reads this module without them.
"""

from __future__ import annotations

import json
import logging
import math
import re
import secrets
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ..family import BatchModel, Capabilities, ModelFamily, OptionSpec, Size, Speech, Utterance, Voices, Word

if TYPE_CHECKING:
    import torch

    from .model import KokoroModel
    from .rows import RowPool
    from .text import Chunk

logger = logging.getLogger(__name__)

CONFIG_FILE, WEIGHTS_FILE, VOICES_DIR = "config.json", "kokoro-v1_0.pth", "voices"
HUB_REPO = "hexgrad/Kokoro-82M"
DEFAULT_VOICE = "af_heart"
"""The voice of a request that names none (the package's and Kokoro-FastAPI's default); the first pack when the
checkpoint lacks it."""
OPENAI_VOICES = {"alloy": "af_alloy", "echo": "am_echo", "fable": "bm_fable", "nova": "af_nova", "onyx": "am_onyx"}
"""OpenAI's voice names that Kokoro v1.0 has namesake packs for."""
OWNED_OPTIONS = frozenset({"phonemes", "lang_code"})
"""Request fields only Kokoro reads (``server.protocol``); another family refuses them by name."""
OPTIONS = ("speed", "phonemes", "lang_code")
"""The keys of ``SamplingParams.options`` Kokoro takes."""
SPEED_RANGE = (0.25, 4.0)  # as OpenAI's speed (audio.stretch.MIN_SPEED, MAX_SPEED)
LANG_FROM = {"zh": "z", "en": None}  # SamplingParams.lang -> a G2P code (None: the voice's English, a or b)
MAX_BLEND = 8  # as server.blend.MAX_BLEND_TERMS
VOICE_LANGUAGES = {
    "a": ("en-US", "American English"),
    "b": ("en-GB", "British English"),
    "e": ("es", "Spanish"),
    "f": ("fr-FR", "French"),
    "h": ("hi", "Hindi"),
    "i": ("it", "Italian"),
    "j": ("ja", "Japanese"),
    "p": ("pt-BR", "Brazilian Portuguese"),
    "z": ("zh-CN", "Mandarin Chinese"),
}
"""A pack name's first letter: its language (BCP 47) and its name (Kokoro's VOICES.md); the second is f or m."""

_NAME = r"[a-z]{2}_[a-z0-9]+"  # voices.VOICE_NAME
_TERM = re.compile(rf"({_NAME})(?:\((\d+(?:\.\d*)?|\.\d+)\))?")
_VOICE_STRING = re.compile(rf"{_NAME}(?:\([\d.]+\))?(?:\+{_NAME}(?:\([\d.]+\))?)*")


class KokoroVoices(Voices):
    """The checkpoint's packs by name; voice strings are names and blends of them (normalised, canonical)."""

    def __init__(self, packs: Mapping[str, torch.Tensor]) -> None:
        self.packs = dict(packs)
        self._aliases = {alias: name for alias, name in OPENAI_VOICES.items() if name in self.packs}
        self._mixed = lru_cache(maxsize=64)(self._mix)

    @property
    def builtin(self) -> tuple[str, ...]:
        return (*sorted(self.packs), *self._aliases)

    @property
    def default(self) -> str:
        return DEFAULT_VOICE if DEFAULT_VOICE in self.packs else min(self.packs)

    def voice(self, name: str) -> str | None:
        return self._aliases.get(name, name)

    def description(self, name: str) -> str:
        pack = self._aliases.get(name, name)
        language = VOICE_LANGUAGES.get(pack[:1], ("", "unknown language"))[1]
        sex = {"f": "female", "m": "male"}.get(pack[1:2])
        what = f"{language}, {sex}" if sex else language
        return f"{name} ({what}; OpenAI voice name for {pack})" if pack != name else f"{name} ({what})"

    def languages(self, name: str) -> tuple[str, ...]:
        tag = VOICE_LANGUAGES.get(self._aliases.get(name, name)[:1])
        return () if tag is None else (tag[0],)

    def is_voice(self, text: str) -> bool:
        return _VOICE_STRING.fullmatch(text) is not None

    def check(self, voice: str) -> None:
        self.terms(voice)

    def terms(self, voice: str) -> list[tuple[str, float]]:
        """A voice string's packs and weights (as written). ValueError saying what is wrong."""
        if not isinstance(voice, str) or not voice:
            raise ValueError(
                "a Kokoro voice is a voice name such as af_heart, or a blend such as af_bella(2)+af_sky(1)"
            )
        parts = voice.split("+")
        if len(parts) > MAX_BLEND:
            raise ValueError(f"a Kokoro voice mixes at most {MAX_BLEND} packs, this one has {len(parts)}")
        out = []
        for part in parts:
            m = _TERM.fullmatch(part)
            if m is None:
                shown = part if len(part) <= 40 else part[:40] + "..."
                raise ValueError(
                    f"{shown!r} is not a Kokoro voice name (xx_name, e.g. af_heart) with an optional (weight)"
                )
            name, weight = m.group(1), float(m.group(2) or 1)
            if name not in self.packs:
                raise ValueError(
                    f"no Kokoro voice {name!r} in this checkpoint (its voices: {', '.join(sorted(self.packs))})"
                )
            if not (math.isfinite(weight) and weight > 0):
                raise ValueError(f"voice {name!r}: a blend weight must be a positive number, got {m.group(2)!r}")
            out.append((name, weight))
        return out

    def blend(self, voices: Sequence[str], weights: Sequence[float]) -> str:
        w = np.asarray(weights, dtype=np.float64)
        if len(voices) != len(w) or not len(w) or not (np.isfinite(w).all() and (w > 0).all()):
            raise ValueError("blend weights must be positive and finite, one per voice")
        mix: dict[str, float] = {}
        for voice, outer in zip(voices, w / w.sum(), strict=True):
            inner = self.terms(voice)
            total = sum(x for _, x in inner)
            for name, x in inner:
                mix[name] = mix.get(name, 0.0) + outer * x / total
        return canonical(mix)

    def pack(self, voice: str) -> torch.Tensor:
        """The [510, 1, 256] pack a voice string speaks with: a pack, or the weighted mean of packs."""
        return self._mixed(voice)

    def _mix(self, voice: str) -> torch.Tensor:
        from .voices import blend_voices

        terms = self.terms(voice)
        if len(terms) == 1:
            return self.packs[terms[0][0]]
        return blend_voices([(self.packs[name], weight) for name, weight in terms])


def canonical(mix: Mapping[str, float]) -> str:
    """A blend's voice string: its packs in order, weights normalised to 6 significant digits (a pack alone: its
    name). Blending a canonical string again gives it back."""
    total = sum(mix.values())
    if len(mix) == 1:
        return next(iter(mix))
    return "+".join(f"{name}({weight / total:.6g})" for name, weight in mix.items())


@dataclass(frozen=True, slots=True)
class KokoroOptions:
    """One request's settled options (``LoadedKokoro.check_options``)."""

    voice: str
    """Its voice string (a pack or a canonical blend)."""
    lang: str
    """The G2P's language: "a", "b" or "z"."""
    speed: float = 1.0
    phonemes: str | None = None


@dataclass(frozen=True, slots=True)
class KokoroInputs:
    """What ``synthesize`` needs for one utterance (``Utterance.inputs``)."""

    chunk: Chunk
    ids: tuple[int, ...]
    style: torch.Tensor
    """[1, 256]: the voice pack's row for the chunk's phoneme count."""
    speed: float
    seed: int
    """The utterance's noise generator starts here (``utterance_seed``)."""


def utterance_seed(seed: int, index: int) -> int:
    """The noise seed of a request's utterance ``index`` (0-based) when the request's seed is ``seed``: the same
    sentence of the same request sounds the same, alone or in any batch, and sentences differ."""
    state = np.random.SeedSequence([seed, index]).generate_state(2, np.uint32)
    return int((int(state[0]) << 32 | int(state[1])) & (2**63 - 1))


def lang_for(voice_or_name: str, lang_code: str | None, lang: str | None) -> str:
    """The G2P language of a request: ``lang_code`` (a Kokoro code or alias), else the common ``lang``, else the
    voice's first letter (a blend: its first pack's), as ``KPipeline`` is picked by the voice."""
    from .text.g2p import ALIASES, LANGS

    if lang_code is not None:
        code = ALIASES.get(lang_code.lower(), lang_code.lower())
        if code not in LANGS:
            raise ValueError(
                f"lang_code: {lang_code!r} is not a language this server phonemizes "
                f"({', '.join(f'{k} {v}' for k, v in LANGS.items())}); for another, send its phonemes"
            )
        return code
    first = voice_or_name[0]
    if lang is not None:
        return LANG_FROM[lang] or ("b" if first == "b" else "a")
    if first not in LANGS:
        raise ValueError(
            f"voice {voice_or_name.split('(')[0]!r} speaks a language this server does not phonemize "
            f"(only {', '.join(LANGS.values())}); send lang_code, or its phonemes"
        )
    return first


class LoadedKokoro(BatchModel):
    """A loaded Kokoro checkpoint on the seam: text -> utterances (host), utterances -> speech (device)."""

    def __init__(self, family: KokoroFamily, root: Path, model: KokoroModel, packs, config) -> None:
        self.family, self.root, self.model, self.config = family, root, model, config
        self._voices = KokoroVoices(packs)
        self._g2p: dict[str, Any] = {}
        self._g2p_lock = threading.Lock()  # one G2P per language, built once, called by one thread at a time
        self._rows: RowPool | None = None  # a CPU batch's rows, one per core (``rows``), made at the first batch

    @property
    def sample_rate(self) -> int:
        return self.model.config.sample_rate

    def _scope(self):
        """TF32 around a forward where ``--audio-dtype tf32`` asked for it on CUDA; strict fp32 otherwise."""
        from ...tf32 import fp32_scope, tf32_scope

        tf32 = self.config.audio_dtype == "tf32" and self.device.type == "cuda"  # resolved once, in ``load``
        return tf32_scope() if tf32 else fp32_scope()

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def voices(self) -> KokoroVoices:
        return self._voices

    def counters(self) -> dict[str, int]:
        return self.model.graphs.counters() if self.model.graphs is not None else {}

    @property
    def vocab(self) -> Mapping[str, int]:
        return self.model.config.vocab

    def identity(self) -> list[str]:
        files = [self.root / CONFIG_FILE, self.root / WEIGHTS_FILE, *sorted((self.root / VOICES_DIR).glob("*.pt"))]
        return [str(self.root.resolve())] + [
            f"{p.relative_to(self.root)}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files if p.exists()
        ]

    def check_options(self, params) -> KokoroOptions:
        from .. import check_foreign

        check_foreign(params, self.family.name)
        options = dict(params.options or {})
        unknown = sorted(set(map(str, options)) - set(OPTIONS))
        if unknown:
            raise ValueError(f"unknown kokoro option(s): {', '.join(unknown)}; Kokoro takes {', '.join(OPTIONS)}")
        speed = options.get("speed", 1.0)
        lo, hi = SPEED_RANGE
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not lo <= speed <= hi:
            raise ValueError(f"speed must be a number in {lo:g}..{hi:g}, got {speed!r}")
        phonemes, lang_code = options.get("phonemes"), options.get("lang_code")
        for name, value in (("phonemes", phonemes), ("lang_code", lang_code)):
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string, got {type(value).__name__}")
        if phonemes is not None:
            from .text import check_phonemes

            check_phonemes(phonemes, self.vocab)
        voice = params.speaker if params.speaker is not None else self.voices.default
        self.voices.check(voice)
        lang = "a" if phonemes is not None and lang_code is None else lang_for(voice, lang_code, params.lang)
        return KokoroOptions(voice, lang, float(speed), phonemes)

    def utterances(self, text: str, params) -> list[Utterance]:
        from .text import chunk_phonemes, phonemes_to_ids
        from .voices import style_for

        options = self.check_options(params)
        if not isinstance(text, str) or not text.strip():
            raise ValueError("text is empty")
        if options.phonemes is not None:  # exact control: the phonemes as given, one utterance (<= 510)
            chunks = [
                (replace(chunk_phonemes(options.phonemes, self.vocab), text=" ".join(text.split())), options.speed)
            ]
        else:  # an SSML document's <prosody rate> wins over the request's speed where it is set, as for ChatTTS
            chunks = [
                (chunk, options.speed if rate is None else min(max(rate, SPEED_RANGE[0]), SPEED_RANGE[1]))
                for part, rate in _prepared(text, params)
                for chunk in self._chunks(part, options.lang, params.split_text)
            ]
        # A chunk of symbols the vocabulary lacks only (they are dropped, as the package drops them) has nothing
        # to speak: it would fail the model's whole batch, other requests' rows included.
        spoken = [(c, ids, v) for c, v in chunks if len(ids := tuple(phonemes_to_ids(c.phonemes, self.vocab))) > 2]
        if not spoken:
            raise ValueError(f"text: nothing Kokoro can speak (no phoneme its vocabulary has) in {text[:60]!r}")
        pack = self.voices.pack(options.voice)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        out = []
        for i, (chunk, ids, speed) in enumerate(spoken):
            # The package styles a chunk by its phoneme string's length, symbols the vocab lacks included.
            style = style_for(pack, len(chunk.phonemes))
            inputs = KokoroInputs(chunk, ids, style, speed, utterance_seed(seed, i))
            out.append(Utterance(chunk.text, len(ids), inputs))
        return out

    def _row_pool(self) -> RowPool:
        import torch

        from .rows import RowPool

        if self._rows is None:  # sized by the engine thread's torch threads (--threads), as a lone row runs
            self._rows = RowPool(torch.get_num_threads())
            if self._rows.workers > 1:
                self.model.text_threads = 1  # a row's F0 the same alone or pooled (``rows``)
        return self._rows

    def _chunks(self, text: str, lang: str, split: bool) -> list[Chunk]:
        from .sentences import sentence_chunks
        from .text import G2P, G2PUnavailable, chunk_text

        with self._g2p_lock:
            try:
                g2p = self._g2p.get(lang) or self._g2p.setdefault(lang, G2P(lang))
            except G2PUnavailable as exc:  # an install away: the request says which
                raise ValueError(f"Kokoro cannot phonemize this language on this server: {exc}") from None
            return sentence_chunks(g2p, text) if split else chunk_text(g2p, text)

    def synthesize(self, batch: Sequence[Utterance]) -> list[Speech]:
        import torch

        from ...engine.batch import pads_rows
        from .model import Utterance as Row
        from .text import word_timestamps

        rows = [
            Row(u.inputs.ids, u.inputs.style, u.inputs.speed, torch.Generator(self.device).manual_seed(u.inputs.seed))
            for u in batch
        ]
        with self._scope():
            if pads_rows(self.device):
                results = self.model.synthesize(rows)
            else:  # each row alone (engine.batch.pads_rows: the one rule for batch families), one per core
                results = self._row_pool().map(lambda row: self.model.synthesize([row])[0], rows)
        out = []
        rate = self.sample_rate
        for u, result in zip(batch, results, strict=True):
            times = word_timestamps(
                u.inputs.chunk, result.durations.tolist(), result.samples_per_frame, rate, self.vocab
            )
            words = tuple(Word(w.word, round(w.start * rate), round(w.end * rate)) for w in times if _is_word(w.word))
            out.append(Speech(result.audio.float().cpu().numpy(), words))
        return out


def _is_word(text: str) -> bool:
    """A caption's word: a token with a letter, digit or ideograph (punctuation marks have times too, and pause
    there, but are not words)."""
    return any(c.isalnum() for c in text)


def _prepared(text: str, params) -> list[tuple[str, float | None]]:
    """The text to phonemize, in stretches each with the rate an SSML document asks for there (None: the
    request's), within ``params.max_text_chars``. SSML (``text.ssml``: say-as, sub, phoneme, breaks, rates) is
    read as for ChatTTS, its break tokens becoming the punctuation Kokoro pauses at (a comma; a sentence end for
    a long break); plain text gets the common options every family honours, markdown cleanup and the lexicon."""
    from ...text.bound import check_chars
    from ...text.lexicon import Lexicon
    from ...text.ssml import is_ssml, parse_ssml

    limit = params.max_text_chars
    check_chars(text, limit, "the request")
    lexicon = params.lexicon
    if isinstance(lexicon, Mapping):
        lexicon = Lexicon.from_entries(lexicon)
    if is_ssml(text):
        ssml = parse_ssml(text, params.lang, lexicon, limit)
        runs = zip([t for t, _ in ssml.runs], ssml.run_rates, strict=True) if ssml.runs else [(ssml.text, ssml.rate)]
        return [(t.replace("[uv_break]", ", ").replace("[lbreak]", ". "), rate) for t, rate in runs]
    if params.text_cleanup == "markdown":
        from ...text.cleanup import clean_markdown

        text = check_chars(clean_markdown(text), limit, "markdown cleanup")
    return [(lexicon.apply(text, limit) if lexicon is not None else text, None)]


class KokoroFamily(ModelFamily):
    name = "kokoro"
    execution = "batch"
    capabilities = Capabilities(streaming="sentence", timestamps="word", refine=False, control_tokens=False)
    hub_repos: ClassVar[tuple[str, ...]] = (HUB_REPO,)
    owned_options = OWNED_OPTIONS
    title = "Kokoro-82M"
    attribution = ("hexgrad", "https://huggingface.co/hexgrad/Kokoro-82M")
    sample_text = "Hello! This is Kokoro, speaking from your own server."

    def request_options(self) -> tuple[OptionSpec, ...]:
        from .text.g2p import LANGS  # torch-free

        return (
            OptionSpec("speed", "number", "Speed", 1.0, *SPEED_RANGE, 0.05),
            OptionSpec(
                "lang_code", "choice", "Language", choices=tuple(LANGS), max_length=8,
                help=", ".join(f"{k}: {v}" for k, v in LANGS.items()) + " (default: the voice's first letter; "
                "aliases such as en-us, zh), as Kokoro-FastAPI's lang_code",
            ),
            OptionSpec(
                "phonemes", "text", "Phonemes", max_length=2048,
                help="speak these phonemes (the vocabulary's symbols, at most 510) exactly instead of the text's",
            ),
        )

    def is_checkpoint(self, root: Path) -> bool:
        # Kokoro's config.json (its iSTFTNet section): an incomplete directory is still Kokoro's, and ``resolve``
        # names what it lacks. Read without torch (the registry detects with this).
        try:
            raw = json.loads((root / CONFIG_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        return isinstance(raw, dict) and "istftnet" in raw

    def resolve(self, path_or_repo: str | Path) -> Path:
        from .checkpoint import CheckpointError, resolve

        root = resolve(path_or_repo)
        if not any((root / VOICES_DIR).glob("*.pt")):
            raise CheckpointError(f"Kokoro checkpoint directory {root} is incomplete; missing: {VOICES_DIR}/*.pt")
        return root

    def write_random(self, directory: str | Path, size: Size = "tiny", seed: int = 0) -> Path:
        from .random_checkpoint import write_random

        return write_random(directory, size, seed=seed)

    def load(self, root: Path, device: torch.device, config) -> LoadedKokoro:
        """On ``device``, the text side in fp32, the decoder in ``--audio-dtype`` (the name ChatTTS's audio decoder
        takes): fp32 (the package's bits), bf16 (``KokoroModel.cast_decoder``; "auto" on CUDA), tf32 (fp32 weights,
        TF32 convolutions on CUDA), or on the CPU an OpenVINO graph (``kernels``: ov-fp32, ov-bf16); ``--precision
        int8`` (the name VITS's int8 decoder takes) quantizes that graph's convolutions (``--precision`` is
        otherwise ChatTTS's GPT's: any other is refused)."""
        import torch

        from ...engine.bucket_graphs import wanted
        from .checkpoint import load
        from .kernels import GRAPH_DTYPES
        from .voices import load_voice, voice_names

        audio_dtype = _audio_dtype(config, torch.device(device).type)
        model = load(root, device)
        packs = {name: load_voice(root, name, model.config.voice_dim) for name in voice_names(root)}
        if audio_dtype in ("bf16", "ov-bf16"):
            from ...cpu import probe

            if torch.device(device).type == "cpu" and not probe().bf16:
                logger.warning("audio_dtype %s on a CPU without AVX-512 BF16 or AMX: emulated, slower than fp32",
                               audio_dtype)
        if audio_dtype == "bf16":
            model.cast_decoder(torch.bfloat16)
        if audio_dtype in GRAPH_DTYPES:
            from .kernels import attach
            from .voices import style_for

            pack = packs[DEFAULT_VOICE if DEFAULT_VOICE in packs else min(packs)]  # int8 calibrates in it
            attach(model, audio_dtype, config.precision == "int8", torch.get_num_threads(), style_for(pack, 40))
            if config.runner.compile:
                logger.info("--compile: the torch decoder's; the %s graph runs in its place", audio_dtype)
        elif config.runner.compile:
            model.compile_decoder()
        config = replace(config, audio_dtype=audio_dtype)  # "auto" resolved once, here
        if config.auto_slots:  # no KV slots to size: --max-num-seqs caps a batch's rows
            config = replace(config, auto_slots=False)
        loaded = LoadedKokoro(self, Path(root), model, packs, config)
        if wanted(model.device, config):  # the decoder per (rows, frames) bucket, captured as it will serve
            from .graphs import KokoroGraphs

            with loaded._scope():
                model.graphs = KokoroGraphs(model, config.scheduler.max_num_seqs,
                                            config.runner.strict_cuda_graphs).capture_all()
        return loaded


def _audio_dtype(config, device_type: str) -> str:
    """The decoder's mode from ``--audio-dtype`` and ``--precision`` (resolved once; ValueError naming the flag where
    Kokoro cannot run the pair). int8 is the OpenVINO graph's: "auto" is then ov-bf16 where the CPU has bf16."""
    from ...engine.plan import resolve_audio_dtype
    from .kernels import GRAPH_DTYPES

    if config.precision not in ("fp32", "int8"):
        raise ValueError(f"the kokoro family runs its text side in fp32; --precision {config.precision} is "
                         "ChatTTS's (Kokoro's decoder takes --audio-dtype, or --precision int8)")
    if config.precision == "int8":
        if device_type != "cpu":
            raise ValueError("--precision int8 runs Kokoro's decoder on the CPU (OpenVINO); on an accelerator use "
                             "--audio-dtype bf16")
        if config.audio_dtype == "auto":
            from ...cpu import probe

            return "ov-bf16" if probe().bf16 else "ov-fp32"
    audio_dtype = resolve_audio_dtype(config.audio_dtype, device_type)
    if config.precision == "int8" and audio_dtype not in GRAPH_DTYPES:
        raise ValueError(f"--precision int8 quantizes Kokoro's OpenVINO graph; --audio-dtype {audio_dtype} is not "
                         f"one (take {', '.join(GRAPH_DTYPES)} or auto)")
    if audio_dtype not in ("fp32", "bf16", "tf32", *GRAPH_DTYPES):
        raise ValueError(f"the kokoro family's decoder runs in fp32, bf16, tf32, {', '.join(GRAPH_DTYPES)}; "
                         f"--audio-dtype {audio_dtype} is ChatTTS's audio stage only")
    return audio_dtype
