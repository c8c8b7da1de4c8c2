"""``EngineCore``: one engine step = schedule -> execute -> update -> audio -> outputs.

With the host one step ahead (``ExecutionPlan.host_ahead`` as ``Stage.runs_ahead``: CUDA's default) a step
is split where the host would wait for the device: schedule step n+1 -> queue it (``Stage.launch``) -> read step n's
tokens (``Stage.collect``, the step's one wait) -> update -> audio -> outputs. The tokens step n+1
feeds back already live on the device (``slot_state``); the host needs them only for stops and audio,
so it schedules and launches the next step before it reads them, and its work on step n overlaps the
device's on step n+1 (SGLang's and vLLM's overlap schedulers). The price: a sequence that ended at
step n (EOS) runs step n+1 too, and that step's token is dropped (``Sequence.discard``); one that
reaches its ``max_new_tokens`` is known to end without its tokens, and is not scheduled again.

The core owns the scheduler (which sequences run) and the step's order; the model family's ``Stage``
(``engine.stage``) owns the rest: what a request becomes, how its sequences run (ChatTTS: the runner's token
step over KV slots; a batch family: whole utterances), the audio stage and the outputs. It is single-threaded
and synchronous: ``Engine`` drives it to completion offline, ``AsyncEngine`` runs it in a background thread
for serving. A failing step or audio decode fails the requests it touched, never the engine.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from ..audio.policy import StreamPolicy
from .config import EngineConfig
from .outputs import RequestOutput, RunnerOutput, SchedulerOutput
from .request import Sequence
from .scheduler import Scheduler
from .stage import Stage

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
    def __init__(self, stage: Stage, config: EngineConfig) -> None:
        """``stage``: the model family's execution (``FamilyModel.stage(config)``); ``config`` the engine's
        (its scheduler's admission is the family's: slots or a work budget)."""
        self.stage = stage
        self.config = config
        self.scheduler = Scheduler(config.scheduler)
        self.device = stage.device
        self.sample_rate = stage.sample_rate
        self.ahead = stage.runs_ahead
        """The host runs one step ahead of the device (see the module docstring)."""
        self._in_flight: tuple[SchedulerOutput, Any] | None = None
        """The step queued on the device whose tokens are not read yet (``ahead`` only)."""

    # ------------------------------------------------------------------ requests

    def prepare(self, text: str, params, max_audio_seconds: float | None = None):
        """Validate and process one text (thread-safe; no device work). Raises ValueError.
        ``max_audio_seconds``: a budget tighter than the engine's (``Stage.prepare``)."""
        return self.stage.prepare(text, params, max_audio_seconds)

    def add_request(
        self,
        request_id: str,
        prepared,
        policy: StreamPolicy | None = None,
        priority: int = 0,
        arrival: float | None = None,
    ) -> None:
        """Queue a prepared request. Raises ValueError (bad request, duplicate id) or QueueFullError."""
        arrival = time.monotonic() if arrival is None else arrival
        seqs = self.stage.start(request_id, prepared, policy or StreamPolicy.one_shot(), priority, arrival)
        try:
            for seq in seqs:
                self.scheduler.add(seq)
        except Exception:
            self.scheduler.abort(request_id)
            self.stage.drop(request_id)
            raise

    def abort(self, request_id: str) -> bool:
        """Stop a request: its sequences leave at the next step; it finishes with reason "aborted"."""
        if not self.stage.end(request_id, "aborted"):
            return False
        self.scheduler.abort(request_id)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.stage.requests) or self.scheduler.has_unfinished() or self._in_flight is not None

    def has_request(self, request_id: str) -> bool:
        return request_id in self.stage.requests

    def can_accept(self, num_seqs: int) -> bool:
        """Whether the waiting queue has room for ``num_seqs`` more sequences (a prepared request
        queues at most ``len(prepared.segments)``). Thread-safe read: the answer may be one step old."""
        return self.scheduler.can_accept(num_seqs)

    def stats(self) -> EngineStats:
        sched = self.scheduler  # one read: ``reset`` may replace it from the engine thread
        slots = sched.config.max_num_seqs
        used = slots - sched.num_free_slots if sched.config.admission == "slots" else sched.num_running
        return EngineStats(
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            kv_slots=slots,
            kv_slots_used=used,
            **self.stage.counters(),
        )

    # ------------------------------------------------------------------ one step

    def step(self) -> list[RequestOutput]:
        if self.ahead:
            sched, done, result = self._step_ahead()
        else:
            sched = done = self.scheduler.schedule(code_room=self.stage.code_room())
            result = self._execute(sched)
        updates = self.scheduler.update(done, result) if result is not None else []
        self._queue(self.stage.update(updates, result))
        # Audio of earlier steps may have run beside this step's model work; wait for it only when there is
        # no model work left to overlap (ChatTTS's overlapped decode; a batch family's audio is done).
        self._queue(self.stage.audio(wait=sched.is_empty and self._in_flight is None))
        outputs = self.stage.outputs()
        for out in outputs:
            out.sample_rate = self.sample_rate
        for request_id in self.stage.take_failed():  # ended by the stage: its other sequences leave
            self.scheduler.abort(request_id)
        return outputs

    def _step_ahead(self) -> tuple[SchedulerOutput, SchedulerOutput, RunnerOutput | None]:
        """Schedule and queue step n+1, then read step n's tokens: (step n+1's schedule, step n's, its
        results or None)."""
        room = self.stage.code_room()
        prev = self._in_flight
        if room is not None and prev is not None:  # the queued step's admissions take their rows when read
            room -= sum(s.kind == "code" for s in prev[0].prefill)
        sched = self.scheduler.schedule(code_room=room)
        launched = None
        try:
            launched = self.stage.launch(sched)
        except Exception as exc:  # a device error fails this step's requests, never the engine
            logger.exception("model step failed")
            self._fail_step(sched, f"model step failed: {exc}")
        if launched is not None:
            self.scheduler.launched(sched)
        self._in_flight = (sched, launched) if launched is not None else None
        if prev is None:
            return sched, sched, None
        try:
            return sched, prev[0], self.stage.collect(prev[1])
        except Exception as exc:
            logger.exception("model step failed")
            for seq in (*prev[0].prefill, *prev[0].decode):
                seq.ahead = max(seq.ahead - 1, 0)
            self._fail_step(prev[0], f"model step failed: {exc}")
            return sched, prev[0], None

    def _fail_step(self, sched: SchedulerOutput, message: str) -> None:
        for seq in (*sched.prefilling(), *sched.decode):
            self._fail(seq.request_id, message)

    def _execute(self, sched: SchedulerOutput) -> RunnerOutput | None:
        """Run the step's sequences (and forget the finished ones); None when nothing ran."""
        try:
            return self.stage.execute(sched)
        except Exception as exc:  # a device error fails this step's requests, never the engine
            logger.exception("model step failed")
            for seq in (*sched.prefilling(), *sched.decode):
                self._fail(seq.request_id, f"model step failed: {exc}")
            return None

    def _queue(self, seqs: list[Sequence]) -> None:
        """Queue the passes that follow accepted requests (never refused for a full queue)."""
        for seq in seqs:
            try:
                self.scheduler.add(seq, continuation=True)
            except ValueError as exc:
                self._fail(seq.request_id, str(exc))

    def reset(self, message: str) -> list[RequestOutput]:
        """After an unexpected error inside a step (state may be half-updated): end every request with
        an error and start the scheduler and the stage's per-step state afresh. The model, its weights
        and its caches are kept (a slot's cache is overwritten by the next prefill)."""
        for request_id in list(self.stage.requests):
            self.stage.end(request_id, "error", message)
        outputs = self.stage.outputs()
        for out in outputs:
            out.sample_rate = self.sample_rate
        self.stage.reset()
        self._in_flight = None  # its sequences are gone with the scheduler
        self.scheduler = Scheduler(self.config.scheduler)
        return outputs

    def close(self) -> None:
        """Let go of the stage's threads (``Stage.close``); the core is not stepped after."""
        self.stage.close()

    def _fail(self, request_id: str, message: str) -> None:
        if self.stage.end(request_id, "error", message):
            self.scheduler.abort(request_id)
