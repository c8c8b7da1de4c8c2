"""``Engine``: the offline entry point. Text in, audio out (at the model's ``sample_rate``).

    engine = Engine.from_pretrained("2Noise/ChatTTS", device="cpu")
    [result] = engine.synthesize("Hello world.", SamplingParams(seed=7, speaker=engine.sample_speaker(1)))

The checkpoint's model family (``models``: detected, or ``family=``) loads it and gives the engine its stage.
For ChatTTS every text goes through the ``EngineCore`` (continuous batching over a static KV cache):
normalise and split into sentences, optionally refine each sentence (GPT text head), generate its audio
codes (GPT audio heads), decode hidden states to mel (Decoder) and mel to audio (Vocos), and join the
sentences. A "batch" family runs whole utterances, batched by a work budget. All texts share the batch; each
text's result does not depend on the others (see ``ModelRunner``).
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

from .. import models
from ..audio.policy import StreamPolicy
from ..device import bind_thread
from ..malloc import keep_big_blocks
from ..models.chattts.config import DEFAULT_MODEL
from ..models.family import BatchModel, FamilyModel, ModelFamily
from ..sampling_params import SamplingParams
from ..tf32 import strict_fp32
from .batch import BatchStage
from .config import EngineConfig
from .core import EngineCore
from .outputs import Result, build_result

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, model: FamilyModel) -> None:
        """``model``: a loaded checkpoint of any family (``ModelFamily.load``), prepared for its ``config``;
        ``from_pretrained`` does all of it. A "batch" family's scheduler admits by work budget."""
        config = model.config
        if model.family.execution == "batch":
            config = replace(config, scheduler=replace(config.scheduler, admission="work"))
        self.family_model = model
        self.config = config
        stage = BatchStage(model, config) if isinstance(model, BatchModel) else model.stage(config)
        self.core = EngineCore(stage, config)
        self._ids = itertools.count()

    @classmethod
    def from_pretrained(
        cls,
        path_or_repo: str | Path = DEFAULT_MODEL,
        device: str | torch.device = "cpu",
        config: EngineConfig | None = None,
        family: str | None = None,
    ) -> Engine:
        """Load a checkpoint of any registered family (``family``: its name, else detected from the files or
        the hub id: ``models.detect``) and prepare it for ``config`` (default: ``EngineConfig()``, fp32 with
        16 KV slots for ChatTTS).

        ChatTTS: with one slot (``EngineConfig.with_slots(1)``) every matmul runs on exactly the rows of a
        batch-1 reference run: fp32 output is bit-identical to chattts. With more, a request's codes do
        not depend on what else runs (batch invariance; in every precision but int8-dynamic).
        ``int8-static`` first calibrates on sample texts (seconds)."""
        config = config or EngineConfig()
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but CUDA is not available")
        fam = models.detect(path_or_repo, family)
        bind_thread(device)  # this thread drives the engine offline: its current device is the engine's
        if device.type == "cuda":
            strict_fp32()  # fp32 means fp32: TF32 only inside a tf32 scope (chattts_serve.tf32)
        else:
            keep_big_blocks()  # big CPU tensors from the heap, not page-faulted in every call (chattts_serve.malloc)
        return cls(fam.load(fam.resolve(path_or_repo), device, config))

    @property
    def family(self) -> ModelFamily:
        return self.family_model.family

    @property
    def sample_rate(self) -> int:
        return self.family_model.sample_rate

    @property
    def voices(self):
        """The model's voices (``models.family.Voices``): built-in names, the voice-string codec, blends."""
        return self.family_model.voices

    @property
    def max_num_seqs(self) -> int:
        return self.core.scheduler.config.max_num_seqs

    @property
    def device(self) -> torch.device:
        return self.core.device

    # ---------------------------------------------------------------------------------------------
    # ChatTTS's own (``models.chattts.family.ChatTTSModel``): what its tools and tests read.

    def _chattts(self, what: str):
        if self.family.name != "chattts":
            raise ValueError(f"{what} is ChatTTS's; this engine serves a {self.family.name} model")
        return self.family_model

    @property
    def model(self):
        """ChatTTS's modules (``LoadedModel``)."""
        return self._chattts("the model's modules").model

    @property
    def tokenizer(self):
        return self._chattts("the tokenizer").tokenizer

    @property
    def layout(self):
        return self._chattts("the model layout").layout

    @property
    def precision(self):
        return self._chattts("the precision spec").layout.precision

    @property
    def speaker_stats(self):
        return self._chattts("speaker statistics").speaker_stats

    @property
    def hidden_size(self) -> int:
        return self._chattts("the hidden size").model.config.gpt.hidden_size

    @property
    def plan(self):
        """ChatTTS's execution plan (``engine.plan.ExecutionPlan``): every "auto" of the config as settled."""
        return self._chattts("the execution plan").plan

    @property
    def decode_mode(self) -> str:
        """ChatTTS's decode step in use: "rows", "static" or "onnx" (the ort-* precisions)."""
        return self._chattts("the decode mode").plan.decode_mode

    @property
    def runner(self):
        """ChatTTS's model runner (``engine.runner.ModelRunner``): what tools read of it (its KV cache
        figures) or set (``stage_timer``, ``use_decode_path``)."""
        self._chattts("the model runner")
        return self.core.stage.runner

    def close(self) -> None:
        """Let go of the engine's own threads (on a CPU with ``audio_overlap``: the audio worker, joined); the
        engine is not used after. Without it they go with the engine (or at exit)."""
        self.core.close()

    def sample_speaker(self, seed: int | None = None) -> str:
        """A random speaker string (compatible with the reference's ``sample_random_speaker``: the same
        global torch seed on CPU gives the same string)."""
        return self._chattts("a random speaker").voices.sample(seed)

    def speaker_from_audio(self, wav: np.ndarray | torch.Tensor) -> str:
        """A 24 kHz mono waveform -> prompt-codes string (the reference's ``sample_audio_speaker``)."""
        from ..models.chattts.speaker import MIN_VOICE_SAMPLES, encode_prompt_codes

        self._chattts("a voice sample")
        wav_t = torch.as_tensor(np.asarray(wav, dtype=np.float32))
        if wav_t.dim() != 1 or wav_t.numel() < MIN_VOICE_SAMPLES:
            raise ValueError(f"expected a 1-D 24 kHz waveform of at least {MIN_VOICE_SAMPLES} samples")
        return encode_prompt_codes(self.core.stage.voice_codes(wav_t))

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
                            raise (ValueError if out.bad_input else RuntimeError)(f"synthesis failed: {out.error}")
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
