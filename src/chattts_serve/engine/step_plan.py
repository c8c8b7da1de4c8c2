"""A step's rows as device index tensors: which slots decode, which rows each kind samples, in which order.

Built on the host from the scheduler's lists (numpy writes into ``HostStaging``), bound to device views
after the step's one staging copy, and kept across steps while the running set stays the same: a
steady decode step then stages nothing at all. Decode rows are in ``SchedulerOutput.decode`` order;
each kind samples its prefills of this step first, then its decodes (the order of its logits).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .outputs import SchedulerOutput
from .request import Sequence
from .sampler import effective_top_k
from .slot_state import HostStaging

KINDS = ("code", "text")


@dataclass(slots=True)
class KindRows:
    """One kind's sequences in a step."""

    kind: str
    rows: int
    """Sampling rows per sequence: one per codebook (code) or 1 (text)."""
    seqs: list[Sequence]
    """Sampling order: this step's prefills of the kind, then its decodes."""
    n_prefill: int
    host_slots: list[int]
    k_max: int
    """The largest effective top_k (``sampler.batched_probs`` needs it on the host)."""
    ids: list[int] = field(default_factory=list)
    slots: torch.Tensor | None = None
    """``[len(seqs)]`` their slots, on the device."""
    dec_pos: torch.Tensor | None = None
    """``[n_decode]`` their rows in the decode batch, on the device."""
    _offsets: tuple[int, int] = (0, 0)

    @property
    def n_decode(self) -> int:
        return len(self.seqs) - self.n_prefill

    @property
    def dec_slots(self) -> torch.Tensor:
        assert self.slots is not None
        return self.slots[self.n_prefill :]

    @property
    def decode_ids(self) -> list[int]:
        return self.ids[self.n_prefill :]


@dataclass(slots=True)
class StepPlan:
    decode_ids: list[int]
    """Seq ids of the decode rows: the key a later step compares to reuse this plan."""
    kinds: list[KindRows]
    """Kinds with at least one sequence this step, code first."""
    max_slot: int
    had_prefill: bool = False
    """This step admitted sequences: its kinds sample them too, so no later step can reuse it (a sequence
    that left at its prefill, finished or failed, would still be sampled)."""
    dec_slots: torch.Tensor | None = None
    """``[n_decode]`` slots in decode order, on the device."""
    _dec_offset: int = 0

    def reusable_for(self, sched: SchedulerOutput) -> bool:
        """No admission and the same decode rows: every index tensor still holds."""
        return not self.had_prefill and not sched.prefill and [s.seq_id for s in sched.decode] == self.decode_ids


def build_plan(sched: SchedulerOutput, staging: HostStaging, num_vq: int, vocab: dict[str, int]) -> StepPlan:
    """Stage the step's index tensors (host only); ``bind`` after the staging copy."""
    dec = sched.decode
    dec_kind = np.fromiter((s.kind == "code" for s in dec), dtype=bool, count=len(dec))
    dec_slots = np.fromiter((s.slot for s in dec), dtype=np.int64, count=len(dec))
    plan = StepPlan([s.seq_id for s in dec], [], int(dec_slots.max()) if len(dec) else -1, bool(sched.prefill))
    if len(dec):
        plan._dec_offset, buf = staging.put(len(dec))
        buf[:] = dec_slots
    for kind in KINDS:
        pre = [s for s in sched.prefill if s.kind == kind]
        pos = np.flatnonzero(dec_kind if kind == "code" else ~dec_kind)
        if not pre and not len(pos):
            continue
        seqs = pre + [dec[i] for i in pos]
        host_slots = [s.slot for s in seqs]
        k_max = max(effective_top_k(s.payload.sampling.top_k, vocab[kind]) for s in seqs)
        rows = num_vq if kind == "code" else 1
        k = KindRows(kind, rows, seqs, len(pre), host_slots, k_max, [s.seq_id for s in seqs])
        off_slots, buf = staging.put(len(seqs))
        buf[:] = host_slots
        off_pos, buf = staging.put(len(pos))
        buf[:] = pos
        k._offsets = (off_slots, off_pos)
        plan.kinds.append(k)
    return plan


def bind(plan: StepPlan, staging: HostStaging) -> None:
    """After ``staging.flush``: the plan's device index tensors (views of the staging twin)."""
    n_dec = len(plan.decode_ids)
    if n_dec:
        plan.dec_slots = staging.get(plan._dec_offset, n_dec)
    for k in plan.kinds:
        k.slots = staging.get(k._offsets[0], len(k.seqs))
        k.dec_pos = staging.get(k._offsets[1], k.n_decode)
