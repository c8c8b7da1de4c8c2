"""Iteration-level (continuous) batching: over a fixed pool of KV-cache slots, or by a work budget. No torch here.

Every step: sequences that finished or were aborted leave and free their slots; every running sequence
whose prompt is in its slot decodes one token; then prompts go into the cache within the step's
prefill-token budget (``max_prefill_tokens``): first the rest of prompts already begun, then waiting
sequences, admitted while a slot is free (highest priority first, then earlier sentences of their request
first, then arrival order: a long request's later sentences cannot starve other requests). A slot is
reserved for a sequence's whole life (prompt + max_new_tokens must fit in it), so a running sequence can
never run out of cache: capacity problems surface as a clear refusal at submission, never as an
out-of-memory error mid-generation.

Chunked prefill (vLLM v1's scheduler): while other sequences decode, a prompt longer than what is left of
the budget goes in chunks over several steps (``prefill_chunk``: each chunk a multiple of that many
positions, the last one the rest), and the decoding sequences take their token every one of those steps:
the budget bounds one step's prefill work, so a burst of long prompts delays a running stream's next
token by at most one budget's prefill. A sequence decodes from the step after its last chunk. With nothing
decoding, prompts go in whole (at least one per step, whatever its length): no stream waits on them, and
one call is cheaper than several.

A model family that runs whole utterances (``execution == "batch"``: Kokoro, VITS) has no slots: with
``admission="work"`` each step admits waiting sequences, in the same order, while the sum of their work
units (``Sequence.prompt_len``: input tokens) fits ``max_batch_work`` and the batch has at most
``max_num_seqs`` rows (the first is always admitted); the step runs them to the end (``RunnerOutput.done``).
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass
from typing import Literal

from .outputs import PrefillChunk, RunnerOutput, SchedulerOutput, StepOutput
from .request import Sequence, SequenceStatus

logger = logging.getLogger(__name__)

MAX_EMPTY_RETRIES = 8


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; try again later."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 16
    """KV-cache slots = sequences decoding at once."""
    max_model_len: int = 4096
    """Positions per slot: prompt + max_new_tokens of any sequence must fit. The official checkpoint's
    ``max_position_embeddings`` (the reference speaks prompts up to it: a voice sample and a refined text
    make prompts long); at most the loaded checkpoint's, and lowered at load where fixed slots of it do not
    fit in memory (``runner.fitted_model_len``)."""
    max_waiting: int = 256
    """Bound of the waiting queue; beyond it submissions are refused with QueueFullError."""
    max_prefill_tokens: int = 2048
    """Prompt tokens prefilled per step while sequences decode: a longer prompt goes in chunks over several
    steps (``prefill_chunk``), so a burst of new requests stalls the running ones by at most this much
    prefill per step (or one ``prefill_chunk``, where the budget is smaller). With nothing decoding, at least
    one whole prompt per step. Also the most tokens one torch prefill call packs together (a step's
    admissions go in one call)."""
    admission: Literal["slots", "work"] = "slots"
    """"slots": a sequence holds a KV slot from admission to its end (autoregressive families). "work": a
    step's batch is admitted by ``max_batch_work`` and runs whole (batch families); set from the family."""
    max_batch_work: int = 4096
    """"work" admission: the work units (input tokens) one step's batch may hold; a sequence of more is
    refused at submission."""
    prefill_chunk: int = 0
    """Chunked prefill: chunks of a prompt are multiples of this many positions (the prefill attention's
    query block, which makes chunked prefill bit-identical to one-shot); 0: prompts go in whole, at least
    one per step (one slot: nothing decodes beside a prompt). Set from the execution plan at load
    (``ExecutionPlan.prefill_chunk``), not a flag."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_model_len", "max_waiting", "max_prefill_tokens", "max_batch_work"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.prefill_chunk, int) or self.prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be an int >= 0, got {self.prefill_chunk!r}")
        if self.admission not in ("slots", "work"):
            raise ValueError(f"admission must be 'slots' or 'work', got {self.admission!r}")


class SlotPool:
    """Free KV-cache slots, handed out lowest first (a min-heap).

    The static decode step runs one batch bucket covering slots ``0..max(live slot)`` (``cuda_graph``): an idle
    slot below the highest live one is padding it computes for nothing. Filling the lowest hole first keeps the
    live rows packed at the low end, so the bucket follows the number of live rows instead of the history of
    which slots were freed last."""

    def __init__(self, num_slots: int) -> None:
        self._free = list(range(num_slots))  # sorted, so already a heap

    def allocate(self) -> int:
        return heapq.heappop(self._free)

    def free(self, slot: int) -> None:
        heapq.heappush(self._free, slot)

    @property
    def num_free(self) -> int:
        return len(self._free)


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.slots = SlotPool(config.max_num_seqs)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._finished: list[Sequence] = []

    # ------------------------------------------------------------------ submission and abort

    def check_fits(self, seq: Sequence) -> None:
        if self.config.admission == "work":
            if seq.prompt_len > self.config.max_batch_work:
                raise ValueError(
                    f"an utterance of {seq.prompt_len} work units exceeds max_batch_work ({self.config.max_batch_work})"
                )
            return
        if seq.max_len > self.config.max_model_len:
            raise ValueError(
                f"prompt ({seq.prompt_len}) + max_new_tokens ({seq.max_new_tokens}) = {seq.max_len} positions "
                f"exceeds max_model_len ({self.config.max_model_len})"
            )

    def can_accept(self, num_seqs: int) -> bool:
        """Whether the waiting queue has room for ``num_seqs`` more sequences (the one bound every
        submission path checks: ``add``, ``Engine.synthesize``, ``AsyncEngine``)."""
        return len(self.waiting) + num_seqs <= self.config.max_waiting

    def add(self, seq: Sequence, continuation: bool = False) -> None:
        """Queue a sequence. ``continuation``: the next pass of an already accepted request (the audio
        pass after refine), which is never refused for a full queue."""
        self.check_fits(seq)
        if not continuation and not self.can_accept(1):
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} sequences)")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Abort every sequence of a request. Waiting ones leave now; running ones free their slot at
        the next ``schedule``. Returns the sequences aborted."""
        aborted = []
        for seq in [s for s in self.waiting if s.request_id == request_id]:
            self.waiting.remove(seq)
            seq.status = SequenceStatus.FINISHED_ABORTED
            aborted.append(seq)
            self._finished.append(seq)  # a restarted sequence may still have runner state to drop
        for seq in self.running:
            if seq.request_id == request_id and not seq.status.is_finished:
                seq.status = SequenceStatus.FINISHED_ABORTED
                aborted.append(seq)
        return aborted

    # ------------------------------------------------------------------ one step

    def schedule(self, code_room: int | None = None) -> SchedulerOutput:
        """The step's sequences. ``code_room``: "code" sequences that may be admitted (each needs the
        stage's room for its audio stream: ``Stage.code_room``); None: no bound. A code sequence at the
        head of the queue with no room waits, and so does everything behind it (queue order is kept)."""
        out = SchedulerOutput(finished=self._finished)
        self._finished = []
        for seq in [s for s in self.running if s.status.is_finished]:
            self._release(seq)
            out.finished.append(seq)
        self.waiting.sort(key=lambda s: (-s.priority, s.rank, s.arrival, s.seq_id))
        if self.config.admission == "work":
            return self._admit_batch(out)
        # A sequence whose queued steps reach its max_new_tokens ends there: no step after them (the
        # host knows it without their tokens). One that ends by EOS runs one discarded step.
        out.decode = [s for s in self.running if not s.prefilling and s.num_generated + s.queued < s.max_new_tokens]
        # Prompts begun in earlier steps hold their code rows (``code_room``) before their first token takes one.
        begun = [s for s in self.running if s.prefilling]
        if code_room is not None:
            code_room -= sum(s.kind == "code" for s in begun)
        budget = self.config.max_prefill_tokens
        for seq in begun:
            taken = self._prefill_chunk(seq, budget, out)
            if not taken:
                return out
            budget -= taken
        while self.waiting and self.slots.num_free:
            seq = self.waiting[0]
            if seq.kind == "code" and code_room is not None and code_room < 1:
                break
            if not self._chunk_size(seq.prompt_len, budget, out):
                break
            self.waiting.pop(0)
            if seq.kind == "code" and code_room is not None:
                code_room -= 1
            seq.num_prefilled = 0
            seq.slot = self.slots.allocate()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= self._prefill_chunk(seq, budget, out)
        return out

    def _chunk_size(self, remaining: int, budget: int, out: SchedulerOutput) -> int:
        """Prompt positions of a sequence with ``remaining`` of them to go that this step takes (0: none, and
        nothing after it either: queue order is kept)."""
        if remaining <= budget:
            return remaining
        first = not out.prefill and not out.partial
        align = self.config.prefill_chunk
        if not out.decode or not align:  # nobody to stall (or no chunks): a whole prompt, the step's first only
            return remaining if first else 0
        size = max(budget, 0) // align * align
        if not size and first:  # a budget under one block still moves the step's first prompt on
            size = align
        return min(size, remaining)

    def _prefill_chunk(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        """Schedule this step's chunk of a running sequence's prompt; returns its positions (0: none)."""
        size = self._chunk_size(seq.prompt_len - seq.num_prefilled, budget, out)
        if not size:
            return 0
        start = seq.num_prefilled
        seq.num_prefilled += size
        if seq.prefilling:
            out.partial.append(PrefillChunk(seq, start, seq.num_prefilled))
        else:
            out.prefill.append(seq)
            if start:
                out.prefill_from[seq.seq_id] = start
        return size

    def _admit_batch(self, out: SchedulerOutput) -> SchedulerOutput:
        """ "work" admission: this step's batch, in queue order, while it fits the work budget and the rows. A
        request's first utterance runs in a batch without its later ones, so its first audio leaves after one
        sentence's work (streaming by sentence), not after the whole text's; they wait one step."""
        budget, rows = self.config.max_batch_work, self.config.max_num_seqs
        starting: set[str] = set()  # requests whose first utterance is in this batch
        i = 0
        while i < len(self.waiting) and len(out.prefill) < rows:
            seq = self.waiting[i]
            if seq.rank > 0 and seq.request_id in starting:
                i += 1
                continue
            if out.prefill and seq.prompt_len > budget:
                break
            self.waiting.pop(i)
            budget -= seq.prompt_len
            if seq.rank == 0:
                starting.add(seq.request_id)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.prefill.append(seq)
        return out

    def launched(self, sched: SchedulerOutput) -> None:
        """``sched``'s step is queued on the device: its sequences' positions count it until its
        ``update`` (``Sequence.ahead``)."""
        for seq in (*sched.prefill, *sched.decode):
            seq.ahead += 1

    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[StepOutput]:
        """Append each sampled token, apply the stop rules, and free the slots of finished sequences; a
        sequence the step ran whole (``result.done``) finishes. A step queued before its sequence left
        the running set (``Sequence.discard``) gives it nothing."""
        outputs = []
        for seq in (*sched.prefill, *sched.decode):
            seq.ahead = max(seq.ahead - 1, 0)
            if seq.discard:
                seq.discard -= 1
                continue
            if seq.status.is_finished:  # aborted while this step ran
                outputs.append(StepOutput(seq, None, finished=True))
                continue
            if seq.seq_id in result.done:
                seq.status = SequenceStatus.FINISHED_STOPPED
                outputs.append(StepOutput(seq, None, finished=True))
                continue
            token = result.tokens[seq.seq_id]
            if seq.eos_id in token:
                if not seq.tokens and seq.retry_empty and not seq.seeded and seq.num_retries < MAX_EMPTY_RETRIES:
                    # The reference generates again when the first step is EOS (new random draws).
                    seq.num_retries += 1
                    self._release(seq)
                    seq.status = SequenceStatus.WAITING
                    self.waiting.append(seq)
                    outputs.append(StepOutput(seq, None, restarted=True))
                    continue
                seq.status = SequenceStatus.FINISHED_STOPPED
                outputs.append(StepOutput(seq, None, finished=True))
                continue
            seq.tokens.append(token)
            if seq.num_generated >= seq.max_new_tokens:
                seq.status = SequenceStatus.FINISHED_LENGTH
            outputs.append(StepOutput(seq, token, result.hidden_rows.get(seq.seq_id), seq.status.is_finished))
        for o in outputs:
            if o.finished and (o.seq.slot is not None or o.seq in self.running):
                self._release(o.seq)
                self._finished.append(o.seq)
        return outputs

    def _release(self, seq: Sequence) -> None:
        seq.discard = seq.ahead  # every step still queued for it: their tokens are not its
        if seq in self.running:
            self.running.remove(seq)
        if seq.slot is not None:
            self.slots.free(seq.slot)
            seq.slot = None

    # ------------------------------------------------------------------ introspection

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_free_slots(self) -> int:
        return self.slots.num_free

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)
