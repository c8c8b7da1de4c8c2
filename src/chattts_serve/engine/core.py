"""``EngineCore``: one engine step = schedule -> execute -> update -> audio -> outputs.

The core owns the scheduler (which sequences run), the runner (the model) and the request pipeline
(what each request's sequences mean). It is single-threaded and synchronous: ``Engine`` drives it to
completion offline, ``AsyncEngine`` runs it in a background thread for serving. A failing step or audio
decode fails the requests it touched, never the engine.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ..audio.decode import resolve_audio_dtype
from ..audio.overlap import AudioDecoder, Entry, split_failed
from ..audio.policy import StreamPolicy
from ..cpu import probe
from ..model.checkpoint import LoadedModel
from ..model.prepare import ModelLayout
from ..model.speaker import MIN_VOICE_SAMPLES
from ..model.tokenizer import Tokenizer
from ..sampling_params import SamplingParams
from ..tf32 import fp32_scope
from .config import EngineConfig
from .input_processor import InputProcessor, PreparedRequest
from .outputs import RequestOutput, SchedulerOutput, StepOutput
from .pipeline import RequestPipeline
from .request import Sequence
from .runner import ModelRunner
from .scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's load (read without locks: each number is current, together they may
    be one step apart)."""

    num_running: int
    """Sequences decoding."""
    num_waiting: int
    """Sequences queued for a KV slot."""
    kv_slots: int
    kv_slots_used: int
    graph_replays: int = 0
    """Static decode steps run by replaying a CUDA graph (since start)."""
    eager_steps: int = 0
    """Static decode steps run eagerly: no graphs (CPU, graphs off), a shape without one, or a graph
    refused by its self-check. 0 in the "rows" and "onnx" decode modes."""
    graphs_refused: int = 0
    """CUDA graphs that failed their start-up self-check (not used)."""
    step_graph_replays: int = 0
    """Decode steps run by replaying a whole-step graph (``engine.step_graph``); these count in
    neither ``graph_replays`` nor ``eager_steps``."""
    step_graph_eager_steps: int = 0
    """Decode steps that ran the whole-step function eagerly (no CUDA, or a refused bucket)."""
    step_graphs_captured: int = 0
    """Whole-step graphs captured (each bucket once, at its first step) and kept."""
    step_graphs_refused: int = 0
    """Whole-step graphs that failed their check against the eager step (their buckets run eagerly)."""


class EngineCore:
    def __init__(self, model: LoadedModel, tokenizer: Tokenizer, config: EngineConfig, layout: ModelLayout) -> None:
        """``model`` prepared by ``model.prepare.prepare_model`` (which returned ``layout``)."""
        self.model = model
        self.config = config
        sc = config.scheduler
        gpt = model.config.gpt
        if sc.max_model_len > gpt.max_position_embeddings:
            raise ValueError(
                f"max_model_len {sc.max_model_len} exceeds the checkpoint's {gpt.max_position_embeddings} positions "
                "(max_position_embeddings)"
            )
        self.scheduler = Scheduler(sc)
        self.runner = ModelRunner(
            model, layout, sc.max_num_seqs, sc.max_model_len, tokenizer.eos_id, config.runner, sc.max_prefill_tokens
        )
        self.device = self.runner.device
        self.inputs = InputProcessor(tokenizer, gpt.hidden_size, gpt.num_vq, config.max_audio_seconds)
        self.pipeline = RequestPipeline(
            tokenizer, gpt.hidden_size, gpt.num_vq, sc.max_model_len, self.device, sc.max_num_seqs
        )
        self.audio_dtype = resolve_audio_dtype(config.audio_dtype, self.device.type)
        if self.audio_dtype == "bf16" and self.device.type == "cpu" and not probe().bf16:
            logger.warning("audio_dtype bf16 on a CPU without AVX-512 BF16 or AMX: emulated, slower than fp32")
        on_cuda = self.device.type == "cuda"
        self.audio = AudioDecoder(
            model,
            self.device,
            self.audio_dtype,
            overlap=config.resolve_audio_overlap(self.device.type),
            buckets=config.resolve_audio_buckets(self.device.type),
        )
        if on_cuda:
            logger.info(
                "audio decode: %s, %s stream, %s windows",
                self.audio_dtype,
                "its own" if self.audio.overlap else "the engine's",
                "bucketed" if self.audio.buckets else "exact-length",
            )

    # ------------------------------------------------------------------ requests

    def prepare(self, text: str, params: SamplingParams, max_audio_seconds: float | None = None) -> PreparedRequest:
        """Validate and normalise one text (thread-safe; no device work). Raises ValueError.
        ``max_audio_seconds``: a budget tighter than the engine's (``InputProcessor.prepare``)."""
        return self.inputs.prepare(text, params, max_audio_seconds)

    def add_request(
        self,
        request_id: str,
        prepared: PreparedRequest,
        policy: StreamPolicy | None = None,
        priority: int = 0,
        arrival: float | None = None,
    ) -> None:
        """Queue a prepared request. Raises ValueError (bad request, duplicate id) or QueueFullError."""
        arrival = time.monotonic() if arrival is None else arrival
        seqs = self.pipeline.start(request_id, prepared, policy or StreamPolicy.one_shot(), priority, arrival)
        try:
            for seq in seqs:
                self.scheduler.add(seq)
        except Exception:
            self.scheduler.abort(request_id)
            self.pipeline.drop(request_id)
            raise

    def abort(self, request_id: str) -> bool:
        """Stop a request: its sequences leave at the next step; it finishes with reason "aborted"."""
        if not self.pipeline.end(request_id, "aborted"):
            return False
        self.scheduler.abort(request_id)
        return True

    def has_unfinished(self) -> bool:
        return self.pipeline.has_requests() or self.scheduler.has_unfinished()

    def has_request(self, request_id: str) -> bool:
        return request_id in self.pipeline.requests

    def can_accept(self, num_seqs: int) -> bool:
        """Whether the waiting queue has room for ``num_seqs`` more sequences (a prepared request
        queues at most ``len(prepared.segments)``). Thread-safe read: the answer may be one step old."""
        return self.scheduler.can_accept(num_seqs)

    def stats(self) -> EngineStats:
        sched = self.scheduler  # one read: ``reset`` may replace it from the engine thread
        slots = sched.config.max_num_seqs
        static, whole = self.runner.static, self.runner.step_graph
        return EngineStats(
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            kv_slots=slots,
            kv_slots_used=slots - sched.num_free_slots,
            graph_replays=static.graph_replays if static else 0,
            eager_steps=static.eager_steps if static else 0,
            graphs_refused=static.graphs_refused if static else 0,
            step_graph_replays=whole.graph_replays if whole else 0,
            step_graph_eager_steps=whole.eager_steps if whole else 0,
            step_graphs_captured=len(whole.graphs) if whole else 0,
            step_graphs_refused=len(whole.refused) if whole else 0,
        )

    # ------------------------------------------------------------------ one step

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        self.runner.release(sched.finished)
        updates, hidden = self._execute(sched)
        # The audio submitted at earlier steps ran beside this step's GPT work; wait for it only when
        # there is no GPT work left to overlap (otherwise take what is done and poll again next step).
        self._accept_audio(self.audio.collect(wait=sched.is_empty))
        self._queue(self.pipeline.update(updates, hidden))
        self._decode_audio()
        self._make_voice_samples()
        outputs = self.pipeline.outputs()
        for request_id in self.pipeline.take_failed():  # ended by the pipeline: its other sequences leave
            self.scheduler.abort(request_id)
        return outputs

    def _execute(self, sched: SchedulerOutput) -> tuple[list[StepOutput], torch.Tensor | None]:
        """The step's outputs, and the code sequences' hidden states they index (``StepOutput.hidden_row``)."""
        if sched.is_empty:
            return [], None
        try:
            result = self.runner.execute(sched)
        except Exception as exc:  # a device error fails this step's requests, never the engine
            logger.exception("model step failed")
            for seq in (*sched.prefill, *sched.decode):
                self._fail(seq.request_id, f"model step failed: {exc}")
            return [], None
        return self.scheduler.update(sched, result), result.hidden

    def _queue(self, seqs: list[Sequence]) -> None:
        """Queue the passes that follow accepted requests (never refused for a full queue)."""
        for seq in seqs:
            try:
                self.scheduler.add(seq, continuation=True)
            except ValueError as exc:
                self._fail(seq.request_id, str(exc))

    def _decode_audio(self) -> None:
        """Decoder + Vocos on every window ready this step, batched across requests: submitted, and
        (without overlap) collected at once. A stream with a window in flight waits for it."""
        windows = [e for e in self.pipeline.windows() if not self.audio.busy(e[2].stream)]
        try:
            done = self.audio.submit(windows)
            if not self.audio.overlap:
                done += self.audio.collect(wait=True)
        except Exception as exc:
            logger.exception("audio decode failed")
            for request_id, _, _ in windows:
                self._fail(request_id, f"audio decode failed: {exc}")
            return
        self._accept_audio(done)

    def _accept_audio(self, done: list[tuple[list[Entry], list]]) -> None:
        for windows, pcm in done:
            # A window that failed alone (out of memory even by itself, or another error) fails its request only.
            failed, ok = split_failed(windows, pcm)
            for request_id, exc in failed.items():
                logger.error("audio decode failed for %s", request_id, exc_info=exc)
                self._fail(request_id, f"audio decode failed: {exc}")
            self.pipeline.accept([windows[i] for i in ok], [pcm[i] for i in ok])

    def _make_voice_samples(self) -> None:
        """DVAE-encode each finished voice step's audio into its request's voice sample."""
        for request_id, wav in self.pipeline.voice_steps_done():
            try:
                # Too little audio to take a voice from: the request keeps its speaker embedding only.
                codes = self.voice_codes(torch.from_numpy(wav)) if len(wav) >= MIN_VOICE_SAMPLES else None
                self._queue(self.pipeline.set_voice_sample(request_id, codes))
            except Exception as exc:
                logger.exception("voice step failed")
                self._fail(request_id, f"voice step failed: {exc}")

    def voice_codes(self, wav: torch.Tensor) -> torch.Tensor:
        """A 1-D 24 kHz waveform -> DVAE codes [4, T_s] on the CPU (a voice sample)."""
        with torch.inference_mode(), fp32_scope():  # the DVAE is fp32: no TF32 convolutions
            return self.model.dvae.encode(wav.to(self.device)).cpu()

    def reset(self, message: str) -> list[RequestOutput]:
        """After an unexpected error inside a step (state may be half-updated): end every request with
        an error and start the scheduler and the runner's sampling state afresh. The model, its weights
        and the KV cache are kept (a slot's cache is overwritten by the next prefill)."""
        for request_id in list(self.pipeline.requests):
            self.pipeline.end(request_id, "error", message)
        outputs = self.pipeline.outputs()
        self.audio.drop()
        self.scheduler = Scheduler(self.config.scheduler)
        self.runner.states.clear()
        return outputs

    def _fail(self, request_id: str, message: str) -> None:
        if self.pipeline.end(request_id, "error", message):
            self.scheduler.abort(request_id)
