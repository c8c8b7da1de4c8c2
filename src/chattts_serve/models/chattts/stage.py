"""``ChatTTSStage``: ChatTTS's execution on the engine (``engine.stage.Stage``, the "slots" shape).

Input processing (``engine.input_processor``), the request pipeline (refine, voice step, code passes:
``engine.pipeline``), the token step over KV slots (``engine.runner``) and the audio stage: hidden states to
mel (Decoder) to waveform (Vocos), batched across requests (``audio.overlap``: on its own CUDA stream, or a CPU's
worker thread, where it can overlap the next GPT step), and the voice step's DVAE encode. What ``EngineCore`` did
itself before the model-family seam, unchanged.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from ...audio.cpu_graph import RUNTIMES as GRAPH_RUNTIMES
from ...audio.cpu_graph import graph_for
from ...audio.graph_cache import default_cache_dir
from ...audio.graphs import AudioGraphs, stream_buckets
from ...audio.overlap import AudioDecoder, Entry, Event, split_failed
from ...audio.policy import StreamPolicy
from ...cpu import probe
from ...device import host_empty, pinned_copy
from ...engine.config import EngineConfig
from ...engine.input_processor import InputProcessor, PreparedRequest
from ...engine.outputs import RequestOutput, RunnerOutput, SchedulerOutput, StepOutput
from ...engine.pipeline import RequestPipeline
from ...engine.plan import ExecutionPlan
from ...engine.request import FinishReason, Sequence
from ...engine.runner import LaunchedStep, ModelRunner
from ...sampling_params import SamplingParams
from ...tf32 import fp32_scope
from .checkpoint import LoadedModel
from .config import SAMPLE_RATE
from .prepare import ModelLayout
from .speaker import MIN_VOICE_SAMPLES
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def check_no_options(params: SamplingParams) -> None:
    """ChatTTS has no options beyond ``SamplingParams``' fields: another family's (``options``) is an error."""
    if params.options:
        names = ", ".join(sorted(map(str, params.options)))
        raise ValueError(f"option(s) {names} are not ChatTTS's; this model is a chattts model")


class ChatTTSStage:
    sample_rate = SAMPLE_RATE

    def __init__(
        self, model: LoadedModel, tokenizer: Tokenizer, config: EngineConfig, layout: ModelLayout, plan: ExecutionPlan
    ) -> None:
        """``model`` prepared by ``models.chattts.prepare.prepare_model`` (which returned ``layout``) for ``plan``
        (``engine.plan``: the config's every "auto" settled)."""
        self.model = model
        self.runs_ahead = plan.host_ahead
        """``launch`` and ``collect`` split every step, the next one queued between them (``engine.core``)."""
        self._failed: list[str] = []
        self._audio_beside = True
        """The last step left a core to the audio worker (``ModelRunner.audio_beside``); else the windows it made
        are decoded on the engine thread, after it, with every core."""
        self._encoding: dict[str, tuple[torch.Tensor, Event] | None] = {}
        """Voice steps whose DVAE encode is queued: request id -> (codes' host buffer, its event), or None
        (too little audio: no sample)."""
        sc = config.scheduler
        gpt = model.config.gpt
        if sc.max_model_len > gpt.max_position_embeddings:
            raise ValueError(
                f"max_model_len {sc.max_model_len} exceeds the checkpoint's {gpt.max_position_embeddings} positions "
                "(max_position_embeddings)"
            )
        self.runner = ModelRunner(
            model,
            layout,
            sc.max_num_seqs,
            sc.max_model_len,
            tokenizer.eos_id,
            plan,
            sc.max_prefill_tokens,
            sc.prefill_chunk,
        )
        self.device = self.runner.device
        self.inputs = InputProcessor(tokenizer, gpt.hidden_size, gpt.num_vq, config.max_audio_seconds)
        self.pipeline = RequestPipeline(
            tokenizer, gpt.hidden_size, gpt.num_vq, sc.max_model_len, self.device, sc.max_num_seqs
        )
        self.audio_dtype = plan.audio_dtype
        if self.audio_dtype in ("bf16", "ov-bf16") and self.device.type == "cpu" and not probe().bf16:
            logger.warning("audio_dtype %s on a CPU without AVX-512 BF16 or AMX: emulated, slower", self.audio_dtype)
        if self.audio_dtype in GRAPH_RUNTIMES:
            # Built now (seconds; read back from the cache at later starts), not in the first request.
            graph_for(model, self.audio_dtype, cache_dir=config.runner.onnx_cache_dir or default_cache_dir())
        self.decoder = AudioDecoder(
            model,
            self.device,
            self.audio_dtype,
            overlap=plan.audio_overlap,
            buckets=plan.audio_buckets,
            threads=plan.audio_threads,
        )
        if plan.audio_graphs:  # captured now, never while serving
            graphs = AudioGraphs(model, self.decoder.stream, self.audio_dtype, stream_buckets(StreamPolicy()))
            graphs.capture_all(self.device)
            self.decoder.graphs = graphs
        if self.device.type == "cuda" or self.decoder.overlap:
            logger.info(
                "audio decode: %s, %s, %s windows",
                self.audio_dtype,
                ("its own stream" if self.device.type == "cuda" else "a worker thread")
                if self.decoder.overlap
                else "the engine's stream",
                "bucketed" if self.decoder.buckets else "exact-length",
            )

    @property
    def requests(self):
        return self.pipeline.requests

    # ------------------------------------------------------------------ requests

    def prepare(self, text: str, params: SamplingParams, max_audio_seconds: float | None = None) -> PreparedRequest:
        if isinstance(params, SamplingParams):
            check_no_options(params)
        return self.inputs.prepare(text, params, max_audio_seconds)

    def start(
        self, request_id: str, prepared: PreparedRequest, policy: StreamPolicy, priority: int, arrival: float
    ) -> list[Sequence]:
        return self.pipeline.start(request_id, prepared, policy, priority, arrival)

    def end(self, request_id: str, status: FinishReason, error: str | None = None) -> bool:
        return self.pipeline.end(request_id, status, error)

    def drop(self, request_id: str) -> None:
        self.pipeline.drop(request_id)

    def take_failed(self) -> list[str]:
        failed, self._failed = self._failed, []
        return self.pipeline.take_failed() + failed

    # ------------------------------------------------------------------ one step

    def code_room(self) -> int:
        return self.pipeline.code_rows_free()

    def execute(self, sched: SchedulerOutput) -> RunnerOutput | None:
        self.runner.release(sched.finished)
        if sched.is_empty:
            return None
        self._audio_beside = self.runner.audio_beside(sched)
        return self.runner.execute(sched)

    def launch(self, sched: SchedulerOutput) -> LaunchedStep | None:
        self.runner.release(sched.finished)
        if sched.is_empty:
            return None
        self._audio_beside = self.runner.audio_beside(sched)
        return self.runner.launch(sched)

    def collect(self, launched: LaunchedStep) -> RunnerOutput:
        return self.runner.collect(launched)

    def update(self, updates: list[StepOutput], result: RunnerOutput | None) -> list[Sequence]:
        # Windows decoded beside this step first (without waiting), then this step's tokens and hidden states.
        self._accept(self.decoder.collect(wait=False))
        return self.pipeline.update(updates, result.hidden if result is not None else None)

    def audio(self, wait: bool) -> list[Sequence]:
        """Collect the overlapped decode (``wait``: nothing else to overlap), decode every window ready, and
        turn finished voice steps into voice samples (their code passes follow)."""
        self._accept(self.decoder.collect(wait=wait))
        self._decode_windows()
        return self._make_voice_samples(wait)

    def outputs(self) -> list[RequestOutput]:
        return self.pipeline.outputs()

    def reset(self) -> None:
        self.decoder.drop()
        for pending in self._encoding.values():
            if pending is not None:
                pending[1].synchronize()  # its buffers must outlive the kernels
        self._encoding.clear()
        self.runner.states.clear()

    def close(self) -> None:
        self.decoder.close()  # a CPU's audio worker thread, joined

    def counters(self) -> dict[str, int]:
        return self.runner.counters()

    # ------------------------------------------------------------------ audio

    def _decode_windows(self) -> None:
        """Decoder + Vocos on every window ready this step, batched across requests: submitted, and
        (without overlap) collected at once. A stream with a window in flight waits for it."""
        if self.decoder.full:  # the device is behind: the windows wait a step rather than the host
            return
        windows = [e for e in self.pipeline.windows() if not self.decoder.busy(e[2].stream)]
        try:
            done = self.decoder.submit(windows, beside=self._audio_beside)
            if not self.decoder.overlap:
                done += self.decoder.collect(wait=True)
        except Exception as exc:
            logger.exception("audio decode failed")
            for request_id, _, _ in windows:
                self._fail(request_id, f"audio decode failed: {exc}")
            return
        self._accept(done)

    def _accept(self, done: list[tuple[list[Entry], list]]) -> None:
        for windows, pcm in done:
            # A window that failed alone (out of memory even by itself, or another error) fails its request only.
            failed, ok = split_failed(windows, pcm)
            for request_id, exc in failed.items():
                logger.error("audio decode failed for %s", request_id, exc_info=exc)
                self._fail(request_id, f"audio decode failed: {exc}")
            self.pipeline.accept([windows[i] for i in ok], [pcm[i] for i in ok])

    def _make_voice_samples(self, wait: bool) -> list[Sequence]:
        """DVAE-encode each finished voice step's audio into its request's voice sample: the encode is
        queued on the device and its codes come back by a non-blocking copy into pinned memory, taken at
        a later step once its event has happened (``wait``: now; there is nothing else to overlap), so
        the engine thread never waits on the device for a voice step."""
        for request_id, wav in self.pipeline.voice_steps_done():
            if request_id in self._encoding:
                continue
            try:
                # Too little audio to take a voice from: the request keeps its speaker embedding only.
                self._encoding[request_id] = self._encode(wav) if len(wav) >= MIN_VOICE_SAMPLES else None
            except Exception as exc:
                logger.exception("voice step failed")
                self._fail(request_id, f"voice step failed: {exc}")
        follow = []
        for request_id, pending in list(self._encoding.items()):
            happened = pending is None or pending[1].query()
            if not (wait or happened):
                continue
            del self._encoding[request_id]
            req = self.pipeline.requests.get(request_id)
            if req is None or req.status is not None:  # ended while its encode ran
                continue
            try:
                if not happened:
                    pending[1].synchronize()  # ``wait``: nothing else to overlap
                follow += self.pipeline.set_voice_sample(request_id, None if pending is None else pending[0])
            except Exception as exc:
                logger.exception("voice step failed")
                self._fail(request_id, f"voice step failed: {exc}")
        return follow

    def _encode(self, wav: np.ndarray) -> tuple[torch.Tensor, Event]:
        """Queue the DVAE encode of a voice step's waveform: (its codes' host buffer, the event after
        which that buffer holds them)."""
        with torch.inference_mode(), fp32_scope():  # the DVAE is fp32: no TF32 convolutions
            codes = self.model.dvae.encode(pinned_copy(torch.from_numpy(wav), self.device))
            host = host_empty(tuple(codes.shape), codes.dtype, self.device)
            host.copy_(codes, non_blocking=True)
        streams = self.decoder.streams
        return host, streams.record(streams.current())

    def voice_codes(self, wav: torch.Tensor) -> torch.Tensor:
        """A 1-D 24 kHz waveform -> DVAE codes [4, T_s] on the CPU (a voice sample), waiting for them
        (``Engine.speaker_from_audio``, between steps)."""
        with torch.inference_mode(), fp32_scope():  # the DVAE is fp32: no TF32 convolutions
            return self.model.dvae.encode(pinned_copy(wav, self.device)).cpu()

    def _fail(self, request_id: str, message: str) -> None:
        """End a request with an error; the core removes its sequences (``take_failed``)."""
        if self.pipeline.end(request_id, "error", message):
            self._failed.append(request_id)
