"""``Stage``: what ``EngineCore`` asks of a model family's execution (``FamilyModel.stage`` builds it).

The core owns the scheduler and the step's order (schedule -> execute -> update -> audio -> outputs); the
stage owns everything the family decides: what a request becomes (input processing and its sequences), how
a step's sequences run (a slot family's token step, a batch family's whole utterances), how model output
becomes audio, and what each request's outputs are. "slots": ``models.chattts.stage.ChatTTSStage``;
"batch": ``engine.batch.BatchStage`` over any ``models.family.BatchModel``.

Every method runs on the engine thread except ``prepare`` (a worker thread: it must be thread-safe and
host-only). A method that fails for one request ends that request (``take_failed``), never the engine.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any, Protocol

from ..audio.policy import StreamPolicy
from .outputs import RequestOutput, RunnerOutput, SchedulerOutput, StepOutput
from .request import FinishReason, Sequence


class Stage(Protocol):
    device: Any
    """The torch device the model runs on."""
    sample_rate: int
    """Hz of the audio ``outputs`` gives (the family model's)."""
    requests: Container[str]
    """The ids of the requests it holds (started, final output not yet given)."""
    runs_ahead: bool
    """The core queues the next step between a step's ``launch`` and its ``collect`` (ChatTTS: the plan's
    ``host_ahead``, ``engine.plan``; a batch family: never); else it calls ``execute``."""

    def prepare(self, text: str, params: Any, max_audio_seconds: float | None = None) -> Any:
        """Validate and process one request's input (``SamplingParams``) -> what ``start`` takes, with a
        ``segments`` list (the queue bound counts one sequence per segment). ``max_audio_seconds``: a budget
        tighter than the engine's (a server's per-request limit). Raises ValueError."""

    def start(
        self, request_id: str, prepared: Any, policy: StreamPolicy, priority: int, arrival: float
    ) -> list[Sequence]:
        """Register a prepared request; its first sequences (the core queues them). Raises ValueError."""

    def code_room(self) -> int | None:
        """How many "code" sequences (audio streams) may be admitted now; None: no bound. ChatTTS: its
        hidden-state rows free (a fixed store, never grown mid-serving)."""

    def execute(self, sched: SchedulerOutput) -> RunnerOutput | None:
        """Forget ``sched.finished``, then run ``sched``'s sequences (None when there are none). Raising fails
        the step's requests."""

    def launch(self, sched: SchedulerOutput) -> Any:
        """``execute``'s first half (``runs_ahead``): forget ``sched.finished`` and queue ``sched``'s step
        without waiting for the device; a handle for ``collect`` (None when there is nothing to run)."""

    def collect(self, launched: Any) -> RunnerOutput:
        """``execute``'s second half: wait for a launched step and hand out its results."""

    def update(self, updates: list[StepOutput], result: RunnerOutput | None) -> list[Sequence]:
        """Apply the scheduler's verdicts on the step; the sequences that follow (queued as continuations)."""

    def audio(self, wait: bool) -> list[Sequence]:
        """The audio stage of this step (``wait``: no model work is left to overlap it with); the sequences
        it makes follow (ChatTTS's voice step). Failures end their requests (``take_failed``)."""

    def outputs(self) -> list[RequestOutput]:
        """This step's outputs: every request's new audio in order; a final output for each that ended."""

    def take_failed(self) -> list[str]:
        """Requests the stage ended with an error since the last call (their sequences must leave)."""

    def end(self, request_id: str, status: FinishReason, error: str | None = None) -> bool:
        """End a request early ("aborted", "error"); its final output follows. False if it is not held."""

    def drop(self, request_id: str) -> None:
        """Forget a request entirely (its sequences were refused)."""

    def reset(self) -> None:
        """After a failed step, with every request ended and its final output given: drop the stage's
        per-step state (in-flight audio, sampler state); keep the model and its caches."""

    def close(self) -> None:
        """Let go of the stage's own threads (ChatTTS's audio worker on a CPU: joined). Not used after."""

    def counters(self) -> dict[str, int]:
        """The stage's own counters for ``EngineStats`` (a slot family's graph replays); may be empty."""
