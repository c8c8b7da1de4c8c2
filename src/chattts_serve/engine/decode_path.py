"""The decode path: how one step's running rows become their next tokens. One protocol, one module per path,
chosen once from the execution plan (``engine.plan``: ``ExecutionPlan.decode``).

    path           module                   trunk step                           heads and sampling     prefill
    "rows"         ``engine.decode_rows``   ``GPT.decode``: each row its keys     eager, per kind        torch
    "static"       ``engine.decode_static`` ``GPT.decode_static`` (CUDA graphs)   eager, per kind        torch
    "step-graph"   ``engine.step_graph``    the static step                      one graph per bucket   torch
    "onnx"         ``engine.decode_onnx``   the ``ort-*`` session                 eager, per kind        ORT

The runner (``engine.runner``) owns what every path shares (the KV cache, the slot state, the heads, the
sampler: ``RunnerParts``), prefills the step's admissions and calls ``DecodePath.decode`` once per step with
a ``DecodeStep``: the step's index plan, its decode rows and its admissions' first logits. A path returns each
kind's tokens (admissions first, then decode rows: the order ``StepPlan`` samples in) and the code decode
rows' hidden states; the runner starts the tokens' one copy back (``ModelRunner.launch``) and reads it when
the step is collected (``ModelRunner.collect``), possibly after the next step was queued. The three eager paths share
``TrunkDecode`` and differ only in ``trunk``. A path also says how the step's prompts go through its trunk
(``prefill``, called by ``engine.prefill_runner.Prefiller``, which embeds the prompts and runs the heads):
``torch_prefill`` (packed prompts, ``models.chattts.prefill``) unless the trunk is not torch's. A path's
``prefill`` takes prompt chunks (chunked prefill: a chunk goes after the positions its prompt's earlier chunks
cached); one that cannot says so in ``engine.plan.PREFILL_CHUNKS`` and its engines prefill whole prompts.

A new trunk backend is one module with a class that takes ``RunnerParts`` and implements ``DecodePath``
(usually a ``TrunkDecode`` with its own ``trunk``, and its own ``prefill`` unless the trunk is torch's), its
entry in ``engine.runner.DECODE_PATHS``, and the rule in ``engine.plan.resolve_plan`` that picks it (with its
name in ``engine.plan.DECODE_PATHS``). ``engine.decode_onnx`` is the example of a backend that is not torch.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .outputs import PrefillChunk
from .plan import ExecutionPlan
from .prefill_runner import Pieces, Prefiller, torch_prefill
from .request import Sequence
from .slot_sampler import SlotSampler
from .slot_state import SlotState
from .step_plan import StepPlan

if TYPE_CHECKING:
    from ..models.chattts.checkpoint import LoadedModel
    from ..models.chattts.gpt import KVCache
    from ..models.chattts.prepare import ModelLayout
    from .cuda_graph import GraphStore


class Heads:
    """The code and text heads over decode rows, the matmul padded to ``pad_rows_to`` rows (batch
    invariance where the CPU layout needs it, ``models.chattts.prepare``)."""

    def __init__(self, model: LoadedModel, pad_rows_to: int) -> None:
        self.embed = model.embed
        self.num_vq = model.config.gpt.num_vq
        self.pad_rows_to = pad_rows_to
        self.vocab = {"code": self.embed.head_code.shape[1], "text": self.embed.head_text.shape[0]}
        """Each kind's vocabulary size."""

    def logits(self, kind: str, h: torch.Tensor, idx: torch.Tensor, n: int) -> torch.Tensor:
        """Logits of rows ``idx`` of ``h`` (``n`` of them): ``[n * num_vq, V]`` (code) or ``[n, V]`` (text)."""
        rows = h.index_select(0, idx)
        m = -(-n // self.pad_rows_to) * self.pad_rows_to
        if m != n:
            rows = torch.cat([rows, rows.new_zeros(m - n, rows.shape[1])])
        if kind == "code":
            return self.embed.code_logits(rows)[: n * self.num_vq]
        return self.embed.text_logits(rows)[:n]


@dataclass(slots=True)
class RunnerParts:
    """What the runner owns and every decode path may use (a path keeps what it needs)."""

    model: LoadedModel
    layout: ModelLayout
    plan: ExecutionPlan
    cache: KVCache
    slot_state: SlotState
    heads: Heads
    sampler: SlotSampler
    graph_store: GraphStore
    """Every CUDA graph of the engine (``engine.cuda_graph``)."""

    @property
    def device(self) -> torch.device:
        return self.cache.k.device


@dataclass(slots=True)
class DecodeStep:
    """One step, as a decode path sees it."""

    plan: StepPlan
    seqs: list[Sequence]
    """The decode rows, in ``SchedulerOutput.decode`` order (may be empty: a step of admissions only)."""
    first: dict[str, torch.Tensor]
    """Each kind's admissions' first logits ``[n_prefill * rows, V]`` (kinds with admissions only)."""
    stage: Callable[[str], AbstractContextManager[Any]]
    """Times a named stage of the step ("decode", "sampling"; ``bench.profile``)."""


@dataclass(slots=True)
class Decoded:
    tokens: list[torch.Tensor]
    """Each kind's tokens in ``StepPlan.kinds`` order: its admissions', then its decode rows'."""
    hidden: torch.Tensor | None
    """``[n, hidden]`` fp32: the code decode rows' final hidden states (None: no code row decoded), a tensor
    of its own, never a graph's static output: the runner may queue the next step before the streams take
    these rows (``ModelRunner.launch``)."""


class DecodePath(Protocol):
    """See the module docstring. ``counters`` feeds ``EngineStats`` (graph replays, eager steps)."""

    name: str

    def decode(self, step: DecodeStep) -> Decoded: ...

    def prefill(self, prefiller: Prefiller, chunks: list[PrefillChunk], last_only: bool = False) -> Pieces:
        """The prompt chunks (slots assigned) through the trunk into their slots, each after the positions
        its prompt's earlier chunks wrote (``PrefillChunk.start``). ``last_only``: only each chunk's last row's
        output is needed (a path may skip the rest's work after their keys and values)."""
        ...

    def counters(self) -> dict[str, int]: ...

    def audio_beside(self, rows: int) -> bool:
        """Whether the audio stage may run beside a step of ``rows`` rows (decode rows and prompt tokens) on a
        CPU's audio worker, or should run on the engine thread after it: the step uses every core."""
        ...


def embed_last(parts: RunnerParts, step: DecodeStep) -> torch.Tensor:
    """The decode rows' input embeddings ``[n, hidden]``: each slot's last token (kept on the device)."""
    embed, plan = parts.model.embed, step.plan
    rows = []
    for k in plan.kinds:
        if k.n_decode:
            last = parts.slot_state.last.index_select(0, k.dec_slots)  # text ids fill every column
            rows.append((k, embed.embed_codes(last) if k.kind == "code" else embed.embed_text(last[:, 0])))
    if len(rows) == 1:
        return rows[0][1]  # one kind: its rows are the decode rows, in order
    emb = torch.empty(len(step.seqs), embed.emb_text.weight.shape[1], device=parts.device)
    for k, part in rows:
        emb.index_copy_(0, k.dec_pos, part)
    return emb


class TrunkDecode:
    """The eager paths: the trunk over the decode rows, then each kind's heads, then each kind's admissions
    and decode rows sampled together (one sampler call per kind)."""

    name = "eager"

    def __init__(self, parts: RunnerParts) -> None:
        self.parts = parts

    def trunk(self, emb: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        """Final-norm hidden states ``[rows, hidden]`` fp32 of the decode rows (rows >= len(step.seqs): padding)."""
        raise NotImplementedError

    def counters(self) -> dict[str, int]:
        return {}

    def audio_beside(self, rows: int) -> bool:
        # ONNX Runtime's own pool: measured better overlapped at any width (ort-int8, 32 streams). The eager
        # torch paths keep overlapping as before; not measured wide.
        return True

    def prefill(self, prefiller: Prefiller, chunks: list[PrefillChunk], last_only: bool = False) -> Pieces:
        return torch_prefill(prefiller, chunks, last_only)

    def decode(self, step: DecodeStep) -> Decoded:
        heads, sampler = self.parts.heads, self.parts.sampler
        logits = {kind: [first] for kind, first in step.first.items()}
        hidden = None
        if step.seqs:
            with step.stage("decode"):
                h = self.trunk(embed_last(self.parts, step), step)
                for k in step.plan.kinds:
                    if k.n_decode:
                        logits.setdefault(k.kind, []).append(heads.logits(k.kind, h, k.dec_pos, k.n_decode))
                        if k.kind == "code":
                            hidden = h.index_select(0, k.dec_pos)
        with step.stage("sampling"):
            tokens = [sampler.sample_kind(k, torch.cat(logits[k.kind])) for k in step.plan.kinds]
        return Decoded(tokens, hidden)
