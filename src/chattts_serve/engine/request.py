"""Sequences as the scheduler sees them: ids, lengths, limits, status. No torch here.

A user request (one text) becomes one or more *sequences*: for every sentence, an optional refine pass
(``kind="text"``: the GPT's text head, one id per step) and an audio pass (``kind="code"``: four codes
per step). Each running sequence owns one KV-cache slot. A batch family's sentence is one ``kind="utterance"``
sequence, run whole in one step (``prompt_len``: its work units; no slot).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any, Literal

SeqKind = Literal["text", "code", "utterance"]
FinishReason = Literal["stop", "length", "aborted", "error"]

_seq_ids = itertools.count()


class SequenceStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    # Everything from here on is finished, so `status.is_finished` is one comparison.
    FINISHED_STOPPED = 2
    FINISHED_LENGTH = 3
    FINISHED_ABORTED = 4

    @property
    def is_finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return {
            SequenceStatus.FINISHED_STOPPED: "stop",
            SequenceStatus.FINISHED_LENGTH: "length",
            SequenceStatus.FINISHED_ABORTED: "aborted",
        }.get(self)


@dataclass(eq=False)
class Sequence:
    request_id: str
    kind: SeqKind
    prompt_len: int
    """Positions the prompt occupies in the cache (text ids plus any voice-sample codes)."""
    min_new_tokens: int
    max_new_tokens: int
    eos_id: int
    """Text: the [Ebreak] id. Code: 625; the sequence stops when any of its 4 codes is EOS."""
    seeded: bool
    retry_empty: bool
    """Start again (new random draws) when the first step is EOS (the reference's ensure_non_empty)."""
    priority: int = 0
    """Higher runs first; then ``rank``, then arrival order."""
    rank: int = 0
    """The sentence's position in its request: a request's k-th sentence queues behind every other
    request's earlier sentences, so a request of many sentences cannot starve the ones after it."""
    arrival: float = 0.0
    payload: Any = None
    """What the runner needs to prefill (ids, speaker, sampling settings); opaque to the scheduler."""
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    slot: int | None = None
    tokens: list[tuple[int, ...]] = field(default_factory=list)
    """Generated tokens (EOS step excluded): 4 codes or 1 text id each."""
    num_retries: int = 0
    num_prefilled: int = 0
    """Prompt positions scheduled into its slot so far (chunked prefill; set at admission): below
    ``prompt_len`` the sequence is still prefilling and does not decode."""
    ahead: int = 0
    """Steps queued on the device for it whose tokens are not applied yet (``EngineCore`` runs the host
    one step ahead: 1 between a step's launch and its ``Scheduler.update``)."""
    discard: int = 0
    """Of those, the ones to drop: it left the running set (finished, restarted, aborted) after they were
    queued (a sequence that ended runs one discarded step)."""

    @property
    def prefilling(self) -> bool:
        """Part of its prompt is still to go into its slot (chunked prefill)."""
        return self.num_prefilled < self.prompt_len

    @property
    def num_generated(self) -> int:
        return len(self.tokens)

    @property
    def max_len(self) -> int:
        """Cache positions this sequence may need (reserved when it is admitted)."""
        return self.prompt_len + self.max_new_tokens

    @property
    def cache_len(self) -> int:
        """Positions written in its slot: the prompt, then every generated token that was fed back,
        counting the tokens of steps queued ahead (on the device, not yet applied here)."""
        return self.prompt_len + max(len(self.tokens) + self.queued - 1, 0)

    @property
    def queued(self) -> int:
        """Its own steps queued ahead: those whose tokens will be applied to it."""
        return self.ahead - self.discard
