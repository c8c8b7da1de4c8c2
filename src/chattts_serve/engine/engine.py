"""``Engine``: the offline entry point. Text in, 24 kHz audio out.

    engine = Engine.from_pretrained("2Noise/ChatTTS", device="cpu")
    [result] = engine.synthesize("Hello world.", SamplingParams(seed=7, speaker=engine.sample_speaker(1)))

Every text goes through the ``EngineCore`` (continuous batching over a static KV cache): normalise and
split into sentences, optionally refine each sentence (GPT text head), generate its audio codes (GPT
audio heads), decode hidden states to mel (Decoder) and mel to audio (Vocos), and join the sentences.
All texts share the batch; each text's result does not depend on the others (see ``ModelRunner``).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..audio.policy import StreamPolicy
from ..device import bind_thread
from ..model import checkpoint
from ..model.checkpoint import LoadedModel
from ..model.config import DEFAULT_MODEL
from ..model.gpt import KVCache
from ..model.prepare import ModelLayout, prepare_model
from ..model.quant import check_supported, parse_precision
from ..model.speaker import MIN_VOICE_SAMPLES, SpeakerStats, encode_prompt_codes, encode_speaker
from ..model.tokenizer import Tokenizer
from ..sampling_params import SamplingParams
from ..tf32 import strict_fp32
from .calibrate import calibrate
from .config import EngineConfig
from .core import EngineCore
from .onednn import bound_kernel_caches
from .outputs import Result, build_result
from .runner import auto_num_slots, fitted_model_len

logger = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        model: LoadedModel,
        tokenizer: Tokenizer,
        speaker_stats: SpeakerStats | None,
        config: EngineConfig,
        layout: ModelLayout,
    ) -> None:
        """``model`` as ``model.prepare.prepare_model`` left it for ``config`` (``layout``);
        ``from_pretrained`` does all of it."""
        self.model = model
        self.config = config
        self.precision = layout.precision
        self.layout = layout
        self.tokenizer = tokenizer
        self.speaker_stats = speaker_stats
        self.core = EngineCore(model, tokenizer, config, layout)
        self._ids = itertools.count()

    @classmethod
    def from_pretrained(
        cls,
        path_or_repo: str | Path = DEFAULT_MODEL,
        device: str | torch.device = "cpu",
        config: EngineConfig | None = None,
    ) -> Engine:
        """Load the official files and prepare the model for ``config`` (default: ``EngineConfig()``,
        fp32 with 16 KV slots).

        With one slot (``EngineConfig.with_slots(1)``) every matmul runs on exactly the rows of a
        batch-1 reference run: fp32 output is bit-identical to chattts. With more, a request's codes do
        not depend on what else runs (batch invariance; in every precision but int8-dynamic).
        ``int8-static`` first calibrates on sample texts (seconds)."""
        config = config or EngineConfig()
        bound_kernel_caches()  # before any weights are packed: oneDNN reads it once (see engine.onednn)
        spec = parse_precision(config.precision)
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but CUDA is not available")
        check_supported(spec, device)
        bind_thread(device)  # this thread drives the engine offline: its current device is the engine's
        if device.type == "cuda":
            strict_fp32()  # fp32 means fp32: TF32 only inside a tf32 scope (chattts_serve.tf32)
        # Every mode starts from the fp32 weights (int8 scales are taken from them, not from bf16).
        model = checkpoint.load(path_or_repo, device=device, dtype=torch.float32)
        kv_dtype = KVCache.dtype_for(config.runner.kv_cache_dtype, spec.trunk_dtype)
        sc = config.scheduler
        if config.auto_slots:  # as many KV slots as half the free memory holds
            n = auto_num_slots(model, sc.max_model_len, device, kv_dtype)
            logger.info("KV cache: %d slots sized from free memory", n)
            config = replace(config, scheduler=replace(sc, max_num_seqs=n), auto_slots=False)
        else:  # fixed slots: as long as memory allows (a slot's prompt grows with the voice sample)
            n = fitted_model_len(model, sc.max_num_seqs, sc.max_model_len, device, kv_dtype)
            if n < sc.max_model_len:
                logger.warning(
                    "KV cache: max_model_len lowered from %d to %d so %d slots fit in free memory "
                    "(set --max-model-len or fewer --max-num-seqs)",
                    sc.max_model_len,
                    n,
                    sc.max_num_seqs,
                )
                config = replace(config, scheduler=replace(sc, max_model_len=n))
        tokenizer = Tokenizer(model.root / checkpoint.TOKENIZER_DIR)
        stats = _speaker_stats(model)
        layout = prepare_model(
            model,
            spec,
            config.scheduler.max_num_seqs,
            compile=config.runner.compile,
            calibrate=lambda m: calibrate(m, tokenizer, stats),
            onnx_cache_dir=config.runner.onnx_cache_dir,
            ort_auto_crossover=config.runner.ort_auto_crossover,
        )
        return cls(model, tokenizer, stats, config, layout)

    @property
    def max_num_seqs(self) -> int:
        return self.core.scheduler.config.max_num_seqs

    @property
    def hidden_size(self) -> int:
        return self.model.config.gpt.hidden_size

    @property
    def device(self) -> torch.device:
        return self.core.device

    @property
    def decode_mode(self) -> str:
        """The decode step in use: "rows", "static" or "onnx" (the ort-* precisions)."""
        return self.core.runner.decode_mode

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
        if wav_t.dim() != 1 or wav_t.numel() < MIN_VOICE_SAMPLES:
            raise ValueError(f"expected a 1-D 24 kHz waveform of at least {MIN_VOICE_SAMPLES} samples")
        return encode_prompt_codes(self.core.voice_codes(wav_t))

    # ---------------------------------------------------------------------------------------------
    # Synthesis

    def synthesize(
        self,
        texts: str | list[str],
        params: SamplingParams | list[SamplingParams] | None = None,
        progress: bool = False,
    ) -> list[Result]:
        """One ``Result`` per text. ``params``: one ``SamplingParams`` for every text, or a list with
        one per text (different speakers, seeds, prompts; all batched together). Raises ``ValueError``
        for bad input before any compute."""
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, (list, tuple)) or not texts:
            raise ValueError("texts must be a non-empty string or list of strings")
        if isinstance(params, (list, tuple)):
            if len(params) != len(texts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(texts)} texts; give one per text")
            per_text = list(params)
        else:
            per_text = [params or SamplingParams()] * len(texts)
        prepared = []
        for i, (text, p) in enumerate(zip(texts, per_text, strict=True)):
            try:
                prepared.append(self.core.prepare(text, p))
            except ValueError as exc:
                msg = str(exc)
                msg = f"text {i} {msg[5:]}" if msg.startswith("text ") else f"text {i}: {msg}"
                raise ValueError(msg) from None
        ids = [f"offline-{next(self._ids)}" for _ in texts]
        pending = dict(zip(ids, prepared, strict=True))
        audio: dict[str, list[np.ndarray]] = {i: [] for i in ids}
        results: dict[str, Result] = {}
        policy = StreamPolicy.one_shot()
        start = time.perf_counter()
        bar = tqdm(total=len(ids), desc="synthesize", unit="text", disable=not progress)
        try:
            while pending or self.core.has_unfinished():
                # Feed the queue up to its bound (sequences = sentences); admission follows this order.
                # An empty queue takes any text (one longer than the bound is then refused by add).
                while pending:
                    rid, prep = next(iter(pending.items()))
                    if self.core.stats().num_waiting and not self.core.can_accept(len(prep.segments)):
                        break
                    self.core.add_request(rid, pending.pop(rid), policy)
                for out in self.core.step():
                    audio[out.request_id].append(out.audio)
                    if out.finished:
                        if out.finish_reason == "error":
                            raise RuntimeError(f"synthesis failed: {out.error}")
                        elapsed = time.perf_counter() - start
                        pcm = audio.pop(out.request_id)
                        results[out.request_id] = build_result(out, np.concatenate(pcm), elapsed)
                        bar.update(1)
        finally:
            bar.close()
            leftover = [rid for rid in ids if rid not in results and self.core.has_request(rid)]
            for rid in leftover:  # after an error or interrupt: leave nothing running
                self.core.abort(rid)
            while any(self.core.has_request(rid) for rid in leftover):
                self.core.step()
        return [results[i] for i in ids]


def _speaker_stats(model: LoadedModel) -> SpeakerStats | None:
    stats = checkpoint.read_speaker_stats(model.root, model.config.gpt.hidden_size)
    if stats is None:
        logger.warning(
            "no speaker statistics for hidden size %d; random speakers unavailable", model.config.gpt.hidden_size
        )
    return stats
