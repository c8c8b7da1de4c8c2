"""VITS as a model family: Hugging Face ``VitsModel`` checkpoints (MMS-TTS: ``facebook/mms-tts-*``), served
through the engine's batch path (``engine.batch.BatchStage``).

``VitsFamily``  finds (config.json with ``model_type`` "vits", model.safetensors, vocab.json), fetches
                (``checkpoint.resolve``: a directory or a hub id), forges (``random_checkpoint``) and loads one.
``ServedVits``  a loaded checkpoint as the engine serves it: text -> sentences -> utterances (``text``), one
                ``VitsModel.synthesize`` per engine step for the whole batch, word timings from the durations.

Options (``SamplingParams.options``, by name): ``speed`` (1 = the checkpoint's own rate; the OpenAI and native
``speed`` arrive here), ``noise_scale`` and ``noise_scale_duration`` (None: the checkpoint's). The seed: the
request's ``seed`` seeds a ``torch.Generator`` per utterance (the first with the seed itself, so a one-sentence
request repeats ``torch.manual_seed(seed)`` before transformers' forward; the next with seeds derived from it),
made when the utterance runs, so its audio does not depend on its batch. No seed: a random one per request.

The MMS-TTS weights are CC-BY-NC 4.0 (non-commercial use only): choosing one is choosing that licence.
"""

from __future__ import annotations

import logging
import math
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ...audio.stretch import MAX_SPEED, MIN_SPEED
from ..family import BatchModel, Capabilities, ModelFamily, OptionSpec, Size, Speech, Utterance, Word
from ..hub import checkpoint_config
from .text import Piece, pieces
from .voices import Mix, VitsVoices

if TYPE_CHECKING:
    import torch

    from .model import VitsModel
    from .tokenizer import VitsTokenizer

# torch and the modules are imported where a model is loaded: the registry, the CLI and the server's schemas
# describe families without them.

logger = logging.getLogger(__name__)

SPEED_RANGE = (MIN_SPEED, MAX_SPEED)
"""``speed``'s bounds: the HTTP API's."""
NOISE_MAX = 10.0
"""``noise_scale`` and ``noise_scale_duration`` are in [0, NOISE_MAX] (the checkpoints' own: 0.667 and 0.8)."""
MAX_UTTERANCE_IDS = 1024
"""Longest utterance in input ids (~500 characters): a longer sentence is cut at words. The text encoder's
attention is quadratic in it, and the work budget (``max_batch_work``) must hold it."""
OPTIONS = ("speed", "noise_scale", "noise_scale_duration")
OWNED_OPTIONS = frozenset({"noise_scale", "noise_scale_duration"})
"""Request fields only VITS reads (``server.protocol``; its ``speed`` is the common one): another family refuses
them by name."""
_BREAK_TOKEN = re.compile(r"\[(?:uv_break|lbreak)\]")  # text.ssml._break's
_SPEED_STEP = re.compile(r"\[speed_(\d)\]")
_SEED_STEP = 0x9E3779B97F4A7C15  # odd: utterance seeds seed + i * step (mod 2**63) are distinct for a request


class MmsRepos(tuple):
    """The hub repos ``detect`` maps to VITS without ``--family``: the listed ones, and any ``facebook/mms-tts-*``
    (1100+ languages, one repo each: all VITS). The registry asks ``repo in family.hub_repos``; this tuple answers
    for the pattern too (the seam has no pattern hook: see docs/vits.md)."""

    _PATTERN = re.compile(r"facebook/mms-tts-[a-z0-9_-]+")

    def __contains__(self, repo: object) -> bool:
        return isinstance(repo, str) and (super().__contains__(repo) or bool(self._PATTERN.fullmatch(repo)))


@dataclass(frozen=True, slots=True)
class VitsOptions:
    """A request's VITS options, checked; None: the checkpoint's config value."""

    speed: float = 1.0
    noise_scale: float | None = None
    noise_scale_duration: float | None = None
    mix: Mix | None = None
    """The voice's speakers (``voices.VitsVoices.mix``); None on a single-speaker checkpoint."""


@dataclass(frozen=True, slots=True)
class VitsInputs:
    """One utterance's input (``Utterance.inputs``): everything to make its audio, its generator's seed included."""

    piece: Piece
    options: VitsOptions
    seed: int


class ServedVits(BatchModel):
    """A loaded VITS checkpoint, served through the engine's batch path."""

    def __init__(self, family: VitsFamily, root: Path, model: VitsModel, tokenizer: VitsTokenizer, config) -> None:
        self.family, self.root, self.model, self.tokenizer, self.config = family, root, model, tokenizer, config
        self._voices = VitsVoices(model.config.num_speakers, tokenizer.language)
        self.max_ids = min(MAX_UTTERANCE_IDS, config.scheduler.max_batch_work)
        self.batches: list[int] = []
        """The size of every batch ``synthesize`` ran (tests and diagnostics read it; bounded)."""

    @property
    def sample_rate(self) -> int:
        return self.model.config.sample_rate

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def voices(self) -> VitsVoices:
        return self._voices

    def counters(self) -> dict[str, int]:
        return self.model.graphs.counters() if self.model.graphs is not None else {}

    def identity(self) -> list[str]:
        from .checkpoint import ADDED_TOKENS_FILE, SPECIAL_TOKENS_FILE, VITS_FILES

        files = []
        for name in (*VITS_FILES, SPECIAL_TOKENS_FILE, ADDED_TOKENS_FILE):
            path = self.root / name
            if path.exists():
                st = path.stat()
                files.append(f"{name}:{st.st_size}:{st.st_mtime_ns}")
        return [str(self.root.resolve()), *files]

    def check_options(self, params) -> VitsOptions:
        from .. import check_foreign

        check_foreign(params, self.family.name)
        given: Mapping[str, Any] = params.options or {}
        unknown = sorted(set(given) - set(OPTIONS))
        if unknown:
            raise ValueError(f"unknown vits option(s): {', '.join(unknown)}; it takes {', '.join(OPTIONS)}")
        speed = _number(given, "speed", *SPEED_RANGE, default=1.0)
        noise = _number(given, "noise_scale", 0.0, NOISE_MAX)
        noise_duration = _number(given, "noise_scale_duration", 0.0, NOISE_MAX)
        return VitsOptions(speed, noise, noise_duration, self._voices.mix(params.speaker))

    def utterances(self, text: str, params) -> list[Utterance]:
        options = self.check_options(params)
        if not isinstance(text, str) or not text.strip():
            raise ValueError("text is empty")
        text, options = _read_text(text, params, options)
        found = pieces(self.tokenizer, text, self.max_ids, split=params.split_text)
        if not found:
            raise ValueError(f"nothing to speak: no character of {text[:40]!r} is in this checkpoint's vocabulary")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        return [
            Utterance(p.text, len(p.ids), VitsInputs(p, options, (seed + i * _SEED_STEP) % 2**63))
            for i, p in enumerate(found)
        ]

    def synthesize(self, batch: Sequence[Utterance]) -> list[Speech]:
        import torch

        from .model import Utterance as Row
        from .model import as_numpy

        rows = []
        for u in batch:
            inputs: VitsInputs = u.inputs
            o, mix = inputs.options, inputs.options.mix
            rows.append(
                Row(
                    inputs.piece.ids,
                    speaking_rate=o.speed * self.model.config.speaking_rate,
                    noise_scale=o.noise_scale,
                    noise_scale_duration=o.noise_scale_duration,
                    generator=torch.Generator().manual_seed(inputs.seed),
                    speaker_id=mix[0][0] if mix is not None and len(mix) == 1 else None,
                    speaker_mix=mix if mix is not None and len(mix) > 1 else None,
                )
            )
        self.batches = [*self.batches[-999:], len(rows)]
        out = []
        for u, syn in zip(batch, self.model.synthesize(rows), strict=True):
            hop = syn.samples_per_frame
            ends = [0, *(int(x) * hop for x in syn.durations.cumsum(0).tolist())]
            words = tuple(Word(w, ends[a], ends[b]) for w, a, b in u.inputs.piece.words)
            out.append(Speech(as_numpy(syn.audio), words))
        return out


def _read_text(text: str, params, options: VitsOptions) -> tuple[str, VitsOptions]:
    """The text to speak: SSML read (``text.ssml``), else markdown cleaned (``text_cleanup``); the lexicon applied.

    SSML's text comes with ChatTTS's break tokens: VITS has no pause to ask for, so a ``<break>`` ends a sentence
    there (no silence is added). Its ``<prosody rate>`` arrives as ChatTTS's ``[speed_N]`` (the seam's one form
    of it) and becomes the speaking rate that step stands for, ``2 ** ((N - 5) / 2.5)``, replacing the request's
    speed as it replaces ChatTTS's prompt."""
    from ...text.lexicon import Lexicon
    from ...text.ssml import is_ssml, parse_ssml

    lexicon = params.lexicon
    if lexicon is not None and not isinstance(lexicon, Lexicon):
        lexicon = Lexicon.from_entries(lexicon)
    if is_ssml(text):
        ssml = parse_ssml(text, params.lang, lexicon)
        if ssml.speed is not None:
            step = int(_SPEED_STEP.fullmatch(ssml.speed).group(1))
            speed = min(max(2 ** ((step - 5) / 2.5), SPEED_RANGE[0]), SPEED_RANGE[1])
            options = replace(options, speed=speed)
        return _BREAK_TOKEN.sub("\n", ssml.text), options
    if params.text_cleanup == "markdown":
        from ...text.cleanup import clean_markdown

        text = clean_markdown(text)
    return (lexicon.apply(text) if lexicon is not None else text), options


def _number(given: Mapping[str, Any], name: str, low: float, high: float, default: float | None = None):
    value = given.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a number in {low:g}..{high:g}, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be a number in {low:g}..{high:g}, got {value!r}")
    return float(value)


class VitsFamily(ModelFamily):
    name = "vits"
    execution = "batch"
    capabilities = Capabilities(streaming="sentence", timestamps="word", refine=False, control_tokens=False)
    hub_repos: ClassVar[tuple[str, ...]] = MmsRepos(("facebook/mms-tts-eng", "facebook/mms-tts-kor"))
    owned_options = OWNED_OPTIONS
    title = "VITS"
    attribution = ("Kim et al. (VITS); Meta AI for MMS-TTS", "https://huggingface.co/docs/transformers/model_doc/vits")

    def request_options(self) -> tuple[OptionSpec, ...]:
        return (  # the noise scales' default is the checkpoint's (MMS-TTS: 0.667 and 0.8)
            OptionSpec("speed", "number", "Speaking rate", 1.0, *SPEED_RANGE, 0.05),
            OptionSpec(
                "noise_scale", "number", "noise_scale", None, 0.0, NOISE_MAX, 0.05,
                help="the prior's noise (variation of the voice within a sentence); 0: none",
            ),
            OptionSpec(
                "noise_scale_duration", "number", "noise_scale_duration", None, 0.0, NOISE_MAX, 0.05,
                help="the stochastic duration predictor's noise (variation of the rhythm); 0: none",
            ),
        )

    def is_checkpoint(self, root: Path) -> bool:
        # checkpoint.is_vits_dir's test plus the vocabulary, without that module (it imports torch).
        raw = checkpoint_config(root, "config.json", "model.safetensors")
        return raw is not None and raw.get("model_type") == "vits" and (root / "vocab.json").is_file()

    def resolve(self, path_or_repo: str | Path) -> Path:
        from .checkpoint import CheckpointError, resolve

        try:
            return resolve(path_or_repo)
        except CheckpointError as exc:  # as a ValueError: the CLI and the server show it without a traceback
            raise ValueError(str(exc)) from None

    def write_random(self, directory: str | Path, size: Size = "tiny", seed: int = 0) -> Path:
        from .random_checkpoint import write_random

        return write_random(directory, size, seed=seed)

    def load(self, root: Path, device: torch.device, config) -> ServedVits:
        """``config.precision``: fp32 (transformers' output bit for bit), or a faster mode for the flow and the
        decoder (``kernels``: bf16, ort-fp32); another precision is refused by name."""
        import torch

        from ...engine.bucket_graphs import wanted
        from .checkpoint import CheckpointError, load
        from .kernels import attach, check_mode
        from .tokenizer import VitsTokenizer

        check_mode(config.precision, torch.device(device))
        try:
            model = load(root, device=device, dtype=torch.float32)
        except CheckpointError as exc:
            raise ValueError(str(exc)) from None
        attach(model, config.precision)
        if wanted(model.device, config):  # the flow and decoder per (rows, frames) bucket, as they serve
            from .graphs import VitsGraphs

            model.graphs = VitsGraphs(model, config.scheduler.max_num_seqs, config.runner.strict_cuda_graphs)
            model.graphs.capture_all()
        logger.info(
            "VITS checkpoint %s: %d Hz, %d speaker(s), %s", root, model.config.sample_rate,
            model.config.num_speakers, config.precision,
        )
        return ServedVits(self, Path(root), model, VitsTokenizer.from_dir(root), config)
