"""``Engine``: the offline entry point. Text in, 24 kHz audio out.

    engine = Engine.from_pretrained("2Noise/ChatTTS", device="cpu")
    [result] = engine.synthesize("Hello world.", SamplingParams(seed=7, speaker=engine.sample_speaker(1)))

Per text: normalise and split into sentences (as the reference), optionally refine the text (GPT text
head), generate audio codes (GPT audio heads), decode hidden states to mel (Decoder) and mel to audio
(Vocos), and join the sentences. Sentences from all texts are generated together in batches.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from tqdm import tqdm

from ..audio.decode import decode
from ..model import checkpoint
from ..model.checkpoint import LoadedModel
from ..model.config import AUDIO_EOS, SAMPLE_RATE
from ..model.speaker import (
    SpeakerStats,
    decode_prompt_codes,
    decode_speaker,
    default_speaker_stats,
    encode_prompt_codes,
    encode_speaker,
    normalized_speaker_embedding,
)
from ..model.tokenizer import Tokenizer, code_prompt, refine_prompt
from ..sampling_params import SamplingParams
from ..text.normalize import Normalizer, split_text
from .generate import GenOutput, GenRequest, StepSampling, generate

logger = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
MAX_TEXT_CHARS = 20_000


@dataclass(slots=True)
class Result:
    audio: np.ndarray
    """float32 mono waveform at ``sample_rate``."""
    codes: np.ndarray
    """int64 ``[T, 4]`` audio codes (all segments, in order)."""
    text: list[str]
    """The text of each segment as spoken (normalised, refined)."""
    finish_reasons: list[Literal["stop", "length", "empty"]]
    sample_rate: int = SAMPLE_RATE

    @property
    def duration(self) -> float:
        return len(self.audio) / self.sample_rate


@dataclass(slots=True)
class _Segment:
    text_index: int
    text: str


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype.lower()]
    except (KeyError, AttributeError):
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}") from None


class Engine:
    def __init__(
        self,
        model: LoadedModel,
        tokenizer: Tokenizer,
        speaker_stats: SpeakerStats | None,
        max_batch_size: int = 16,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.normalizer = Normalizer()
        self.speaker_stats = speaker_stats
        self.max_batch_size = max_batch_size

    @classmethod
    def from_pretrained(
        cls,
        path_or_repo: str | Path = checkpoint.HF_REPO,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "float32",
        max_batch_size: int = 16,
    ) -> Engine:
        torch_dtype = parse_dtype(dtype)
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but CUDA is not available")
        model = checkpoint.load(path_or_repo, device=device, dtype=torch_dtype)
        tokenizer = Tokenizer(model.root / checkpoint.TOKENIZER_DIR)
        stats = _speaker_stats(model)
        return cls(model, tokenizer, stats, max_batch_size)

    @property
    def hidden_size(self) -> int:
        return self.model.config.gpt.hidden_size

    @property
    def device(self) -> torch.device:
        return self.model.embed.emb_text.weight.device

    # ---------------------------------------------------------------------------------------------
    # Speakers

    def sample_speaker(self, seed: int | None = None) -> str:
        """A random speaker string (compatible with the reference's ``sample_random_speaker``: the same
        global torch seed on CPU gives the same string)."""
        if self.speaker_stats is None:
            raise ValueError("this checkpoint has no speaker statistics; pass a speaker string instead")
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        return encode_speaker(self.speaker_stats.sample(gen))

    def speaker_from_audio(self, wav: np.ndarray | torch.Tensor) -> str:
        """A 24 kHz mono waveform -> prompt-codes string (the reference's ``sample_audio_speaker``)."""
        wav_t = torch.as_tensor(np.asarray(wav, dtype=np.float32))
        if wav_t.dim() != 1 or wav_t.numel() < 2048:
            raise ValueError("expected a 1-D 24 kHz waveform of at least 2048 samples")
        with torch.inference_mode():
            codes = self.model.dvae.encode(wav_t.to(self.device))
        return encode_prompt_codes(codes.cpu())

    def _speaker_embedding(self, speaker: str | None) -> torch.Tensor | None:
        if speaker is None:
            return None
        emb = decode_speaker(speaker, expected_dim=self.hidden_size)
        return normalized_speaker_embedding(torch.from_numpy(emb)).to(self.device)

    # ---------------------------------------------------------------------------------------------
    # Text

    def _prepare(self, texts: list[str], params: SamplingParams) -> list[_Segment]:
        segments: list[_Segment] = []
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise ValueError(f"text {i} must be a string, got {type(text).__name__}")
            if not text.strip():
                raise ValueError(f"text {i} is empty")
            if len(text) > MAX_TEXT_CHARS:
                raise ValueError(f"text {i} has {len(text)} characters; the limit is {MAX_TEXT_CHARS}")
            unknown = self.tokenizer.unknown_tags(text)
            if unknown:
                known = ", ".join(sorted(self.tokenizer.control_tokens))
                raise ValueError(f"text {i} has unknown control token(s) {', '.join(unknown)}; known: {known}")
            pieces = split_text(text) if params.split_text else [text]
            kept = 0
            for piece in pieces:
                norm = self.normalizer(
                    piece, params.do_text_normalization, params.do_homophone_replacement, params.lang
                )
                if norm.strip():
                    segments.append(_Segment(i, norm))
                    kept += 1
            if not kept:
                raise ValueError(f"text {i} has nothing to speak after normalisation: {text!r}")
        for prompt_name, prompt in (("prompt", params.prompt), ("refine.prompt", params.refine.prompt)):
            unknown = self.tokenizer.unknown_tags(prompt)
            if unknown:
                raise ValueError(f"{prompt_name} has unknown control token(s) {', '.join(unknown)}")
        return segments

    def refine_text(self, texts: list[str], params: SamplingParams, progress: bool = False) -> list[str]:
        """The refine_text pass on already-normalised texts: returns the rewritten texts."""
        r = params.refine
        sampling = StepSampling(
            (float(r.temperature),),
            r.top_p,
            r.top_k,
            r.repetition_penalty,
            r.min_new_tokens,
            r.max_new_tokens,
            params.refine_seed,
            params.ensure_non_empty,
        )
        reqs = [GenRequest(self.tokenizer.encode(refine_prompt(t, r.prompt)), sampling) for t in texts]
        outs = self._generate_batched(reqs, "text", progress)
        refined = []
        for o in outs:
            ids = [i for i in o.ids.tolist() if i < self.tokenizer.break_0_id]
            refined.append(self.tokenizer.decode(ids))
        return refined

    # ---------------------------------------------------------------------------------------------
    # Synthesis

    def synthesize(
        self,
        texts: str | list[str],
        params: SamplingParams | None = None,
        progress: bool = False,
    ) -> list[Result]:
        """One ``Result`` per text. Raises ``ValueError`` for bad input before any compute."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, (list, tuple)) or not texts:
            raise ValueError("texts must be a non-empty string or list of strings")
        segments = self._prepare(list(texts), params)
        speaker = self._speaker_embedding(params.speaker)
        sample_codes = None
        if params.speaker_sample is not None:
            sample_codes = decode_prompt_codes(params.speaker_sample).t().contiguous()  # [T_s, 4]
            if (
                sample_codes.numel() == 0
                or sample_codes.shape[1] != self.model.config.gpt.num_vq
                or int(sample_codes.max()) >= AUDIO_EOS
            ):
                raise ValueError("speaker_sample does not hold valid [4, T] audio codes")

        seg_texts = [s.text for s in segments]
        if params.refine_text:
            seg_texts = self.refine_text(seg_texts, params, progress)
        sampling = StepSampling(
            params.temperatures,
            params.top_p,
            params.top_k,
            params.repetition_penalty,
            params.min_new_tokens,
            params.max_new_tokens,
            params.seed,
            params.ensure_non_empty,
        )
        reqs = [
            GenRequest(
                self.tokenizer.encode(code_prompt(t, params.prompt, speaker is not None, params.speaker_sample_text)),
                sampling,
                speaker=speaker,
                speaker_token_id=self.tokenizer.spk_emb_id,
                prompt_codes=sample_codes,
            )
            for t in seg_texts
        ]
        outs = self._generate_batched(reqs, "code", progress)

        results = []
        for i in range(len(texts)):
            idx = [k for k, s in enumerate(segments) if s.text_index == i]
            audio = [decode(self.model, outs[k].hiddens, outs[k].ids) for k in idx]
            codes = [outs[k].ids.numpy() for k in idx]
            results.append(
                Result(
                    audio=np.concatenate(audio) if audio else np.zeros(0, np.float32),
                    codes=np.concatenate(codes).astype(np.int64) if codes else np.zeros((0, 4), np.int64),
                    text=[seg_texts[k] for k in idx],
                    finish_reasons=[outs[k].finish_reason for k in idx],
                )
            )
        return results

    def _generate_batched(self, reqs: list[GenRequest], mode, progress: bool) -> list[GenOutput]:
        outs: list[GenOutput] = []
        batches = range(0, len(reqs), self.max_batch_size)
        for start in tqdm(batches, desc=f"{mode} batches", disable=not progress or len(batches) < 2):
            chunk = reqs[start : start + self.max_batch_size]
            outs += generate(self.model, chunk, mode, eos_id=self.tokenizer.eos_id, progress=progress)
        return outs


def _speaker_stats(model: LoadedModel) -> SpeakerStats | None:
    custom = model.root / checkpoint.SPK_STAT
    if custom.is_file():
        stats = SpeakerStats.from_string(custom.read_text().strip())
    elif model.config.gpt.hidden_size == default_speaker_stats().dim:
        stats = default_speaker_stats()
    else:
        logger.warning(
            "no speaker statistics for hidden size %d; random speakers unavailable",
            model.config.gpt.hidden_size,
        )
        return None
    if stats.dim != model.config.gpt.hidden_size:
        raise checkpoint.CheckpointError(
            f"{checkpoint.SPK_STAT}: {stats.dim}-dim statistics for a {model.config.gpt.hidden_size}-dim model"
        )
    return stats
