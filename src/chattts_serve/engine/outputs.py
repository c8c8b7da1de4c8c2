"""The contracts between the stages of one engine step (no torch in the scheduler-facing parts).

SchedulerOutput  scheduler -> runner: which sequences prefill and which decode this step
RunnerOutput     runner -> scheduler: the token(s) sampled for each of them
StepOutput       scheduler -> pipeline: what each sequence gained, and whether it finished
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .request import Sequence


@dataclass(slots=True)
class SchedulerOutput:
    prefill: list[Sequence] = field(default_factory=list)
    """Newly admitted: prompt into their slot, then their first token."""
    decode: list[Sequence] = field(default_factory=list)
    """Running: one token each."""
    finished: list[Sequence] = field(default_factory=list)
    """Left the running set since the last step (aborted, or finished in the last update)."""

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode


@dataclass(slots=True)
class RunnerOutput:
    tokens: dict[int, tuple[int, ...]]
    """seq_id -> the sampled token (4 codes, or 1 text id)."""
    hidden: dict[int, Any] = field(default_factory=dict)
    """seq_id -> the hidden state ([hidden], on the device) that predicted the token (code sequences)."""


@dataclass(slots=True)
class StepOutput:
    seq: Sequence
    token: tuple[int, ...] | None
    """The kept token of this step; None when the step ended the sequence (EOS) or restarted it."""
    hidden: Any = None
    finished: bool = False
    restarted: bool = False
    """The first step was EOS and the sequence goes back to the queue for new draws."""
