"""``ChatTTSStage``: ChatTTS's execution on the engine (``engine.stage.Stage``, the "slots" shape).

Input processing (``engine.input_processor``), the request pipeline (refine, voice step, code passes:
``engine.pipeline``), the token step over KV slots (``engine.runner``) and the audio stage: hidden states to
mel (Decoder) to waveform (Vocos), batched across requests (``audio.overlap``: on its own CUDA stream where
it can overlap the next GPT step), and the voice step's DVAE encode. What ``EngineCore`` did itself before
the model-family seam, unchanged.
"""

from __future__ import annotations

import logging

import torch

from ...audio.overlap import AudioDecoder, Entry, split_failed
from ...audio.policy import StreamPolicy
from ...cpu import probe
from ...engine.config import EngineConfig
from ...engine.input_processor import InputProcessor, PreparedRequest
from ...engine.outputs import RequestOutput, RunnerOutput, SchedulerOutput, StepOutput
from ...engine.pipeline import RequestPipeline
from ...engine.plan import ExecutionPlan
from ...engine.request import FinishReason, Sequence
from ...engine.runner import ModelRunner
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
        self._failed: list[str] = []
        sc = config.scheduler
        gpt = model.config.gpt
        if sc.max_model_len > gpt.max_position_embeddings:
            raise ValueError(
                f"max_model_len {sc.max_model_len} exceeds the checkpoint's {gpt.max_position_embeddings} positions "
                "(max_position_embeddings)"
            )
        self.runner = ModelRunner(
            model, layout, sc.max_num_seqs, sc.max_model_len, tokenizer.eos_id, plan, sc.max_prefill_tokens
        )
        self.device = self.runner.device
        self.inputs = InputProcessor(tokenizer, gpt.hidden_size, gpt.num_vq, config.max_audio_seconds)
        self.pipeline = RequestPipeline(
            tokenizer, gpt.hidden_size, gpt.num_vq, sc.max_model_len, self.device, sc.max_num_seqs
        )
        self.audio_dtype = plan.audio_dtype
        if self.audio_dtype == "bf16" and self.device.type == "cpu" and not probe().bf16:
            logger.warning("audio_dtype bf16 on a CPU without AVX-512 BF16 or AMX: emulated, slower than fp32")
        self.decoder = AudioDecoder(
            model,
            self.device,
            self.audio_dtype,
            overlap=plan.audio_overlap,
            buckets=plan.audio_buckets,
        )
        if self.device.type == "cuda":
            logger.info(
                "audio decode: %s, %s stream, %s windows",
                self.audio_dtype,
                "its own" if self.decoder.overlap else "the engine's",
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

    def execute(self, sched: SchedulerOutput) -> RunnerOutput | None:
        self.runner.release(sched.finished)
        return None if sched.is_empty else self.runner.execute(sched)

    def update(self, updates: list[StepOutput], result: RunnerOutput | None) -> list[Sequence]:
        # Windows decoded beside this step first (without waiting), then this step's tokens and hidden states.
        self._accept(self.decoder.collect(wait=False))
        return self.pipeline.update(updates, result.hidden if result is not None else None)

    def audio(self, wait: bool) -> list[Sequence]:
        """Collect the overlapped decode (``wait``: nothing else to overlap), decode every window ready, and
        turn finished voice steps into voice samples (their code passes follow)."""
        self._accept(self.decoder.collect(wait=wait))
        self._decode_windows()
        return self._make_voice_samples()

    def outputs(self) -> list[RequestOutput]:
        return self.pipeline.outputs()

    def reset(self) -> None:
        self.decoder.drop()
        self.runner.states.clear()

    def counters(self) -> dict[str, int]:
        return self.runner.counters()

    # ------------------------------------------------------------------ audio

    def _decode_windows(self) -> None:
        """Decoder + Vocos on every window ready this step, batched across requests: submitted, and
        (without overlap) collected at once. A stream with a window in flight waits for it."""
        windows = [e for e in self.pipeline.windows() if not self.decoder.busy(e[2].stream)]
        try:
            done = self.decoder.submit(windows)
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

    def _make_voice_samples(self) -> list[Sequence]:
        """DVAE-encode each finished voice step's audio into its request's voice sample."""
        follow = []
        for request_id, wav in self.pipeline.voice_steps_done():
            try:
                # Too little audio to take a voice from: the request keeps its speaker embedding only.
                codes = self.voice_codes(torch.from_numpy(wav)) if len(wav) >= MIN_VOICE_SAMPLES else None
                follow += self.pipeline.set_voice_sample(request_id, codes)
            except Exception as exc:
                logger.exception("voice step failed")
                self._fail(request_id, f"voice step failed: {exc}")
        return follow

    def voice_codes(self, wav: torch.Tensor) -> torch.Tensor:
        """A 1-D 24 kHz waveform -> DVAE codes [4, T_s] on the CPU (a voice sample)."""
        with torch.inference_mode(), fp32_scope():  # the DVAE is fp32: no TF32 convolutions
            return self.model.dvae.encode(wav.to(self.device)).cpu()

    def _fail(self, request_id: str, message: str) -> None:
        """End a request with an error; the core removes its sequences (``take_failed``)."""
        if self.pipeline.end(request_id, "error", message):
            self._failed.append(request_id)
