"""Prefill for the model runner: the prompts admitted in a step into their KV slots, then each prompt's
last hidden state and first logits, batched per kind.

Trunk. How the prompts go through the trunk is the decode path's (``DecodePath.prefill``: one of the two
functions here, or a new backend's own). Torch modes (``torch_prefill``): the prompts go through the trunk
together, packed one after another (``models.chattts.prefill``: the projections on all their tokens at once,
attention prompt by prompt), in calls of at most ``max_prefill_tokens`` tokens; a prompt's result is the one
it gets alone wherever the layout keeps matmul rows independent (every mode but int8-dynamic; see
``models.chattts.prepare``). ``ort-*`` modes (``onnx_prefill``): the prompts of sequences in consecutive slots
go in one ONNX Runtime call, right-padded to the longest (``query_seqlens`` tells the op each row's length).
Either way a burst of 32 admissions is one call, not 32, each of which would stream all the weights once.

Heads. The reference runs every prompt position through the heads and keeps the last. Where a row's
logits do not depend on the other rows of the matmul (oneDNN-packed heads: the CPU layouts of more
than one slot) the last rows of all the step's prompts of a kind go through the heads in one call:
the same bits, a fraction of the work and one launch per head. On CUDA too (one call instead of one
per prompt; cuBLAS makes no promise about rows either way). The reference-exact layout (one slot,
plain fp32 ``F.linear``) keeps the reference's own matmul: all positions, one prompt at a time (one
slot admits one prompt per step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..device import pinned_copy
from ..models.chattts.checkpoint import LoadedModel
from ..models.chattts.prefill import prefill_prompts
from .request import Sequence


@dataclass(frozen=True, slots=True)
class StepSampling:
    """How one sequence samples (its length limits are the ``Sequence``'s own)."""

    temperature: tuple[float, ...]  # 1 value (text) or one per codebook (code)
    top_p: float
    top_k: int
    repetition_penalty: float
    seed: int | None
    """Generator noise: re-seed before every step; counter noise: the hash's seed (None: one drawn
    from the global RNG at admission). See ``engine.noise``."""


@dataclass(slots=True)
class SeqInputs:
    """``Sequence.payload``: what the runner needs to prefill a sequence."""

    ids: list[int]  # prompt token ids
    sampling: StepSampling
    speaker: torch.Tensor | None = None  # [hidden] normalized; replaces the [spk_emb] position
    speaker_token_id: int | None = None
    prompt_codes: torch.Tensor | None = None  # [T_s, 4] voice-sample codes after the text


@dataclass(slots=True)
class KindPrefill:
    """One kind's prompts of a step, in admission order."""

    seqs: list[Sequence]
    last: torch.Tensor
    """``[n, hidden]`` fp32: each prompt's last hidden state."""
    logits: torch.Tensor
    """``[n * rows, vocab]`` fp32: each prompt's first logits (code: one row per codebook)."""


Pieces = list[tuple[dict[int, int], torch.Tensor]]
"""A prefill's trunk output: pieces of (seq id -> its first row, final-norm hidden states ``[rows, hidden]`` fp32)."""


class Prefiller:
    def __init__(
        self,
        model: LoadedModel,
        cache,
        trunk,
        pad_rows_to: int,
        max_prefill_tokens: int,
        trunk_rows: Callable[[Prefiller, list[Sequence]], Pieces],
    ) -> None:
        """``trunk``: the ``ort-*`` session (None in the torch modes); ``cache``: the runner's slot cache;
        ``trunk_rows``: how the prompts go through the trunk (the decode path's ``prefill``)."""
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens!r}")
        self.model, self.cache, self.trunk, self.trunk_rows = model, cache, trunk, trunk_rows
        self.pad_rows_to, self.max_prefill_tokens = pad_rows_to, max_prefill_tokens
        self.device = model.embed.emb_text.weight.device
        self.dtype = model.gpt.norm.weight.dtype
        self.num_vq = model.config.gpt.num_vq
        self.last_rows_heads = model.embed.heads_packed or self.device.type != "cpu"
        """The heads see only each prompt's last row, all prompts of a kind at once (module docstring)."""

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Host -> device; on CUDA through pinned memory without blocking the host."""
        return pinned_copy(t, self.device)

    def run(self, seqs: list[Sequence]) -> dict[str, KindPrefill]:
        """Prefill ``seqs`` (their slots assigned): per kind present, their last hidden states and logits."""
        flat, starts = self._trunk_rows(seqs)
        ends = {s.seq_id: starts[s.seq_id] + s.prompt_len for s in seqs}
        embed = self.model.embed
        out: dict[str, KindPrefill] = {}
        for kind in ("code", "text"):
            group = [s for s in seqs if s.kind == kind]
            if not group:
                continue
            last_at = np.fromiter((ends[s.seq_id] - 1 for s in group), dtype=np.int64, count=len(group))
            last = flat.index_select(0, self._to_device(torch.from_numpy(last_at)))
            if self.last_rows_heads:
                logits = embed.code_logits(last) if kind == "code" else embed.text_logits(last)
            else:  # the reference's matmul: every position of one prompt, the last kept
                parts = []
                for s in group:
                    h = flat[starts[s.seq_id] : ends[s.seq_id]]
                    parts.append(embed.code_logits(h)[-self.num_vq :] if kind == "code" else embed.text_logits(h)[-1:])
                logits = torch.cat(parts) if len(parts) > 1 else parts[0]
            out[kind] = KindPrefill(group, last, logits)
        return out

    def trunk_outputs(self, seqs: list[Sequence]) -> dict[int, torch.Tensor]:
        """Trunk outputs ``[prompt_len, hidden]`` (all positions through the final norm, as the reference
        computes them before taking the last) of every sequence in ``seqs``, by seq id."""
        flat, starts = self._trunk_rows(seqs)
        return {s.seq_id: flat[starts[s.seq_id] : starts[s.seq_id] + s.prompt_len] for s in seqs}

    def _trunk_rows(self, seqs: list[Sequence]) -> tuple[torch.Tensor, dict[int, int]]:
        """Every prompt's trunk output in one fp32 tensor ``[rows, hidden]``, and where each starts."""
        pieces = self.trunk_rows(self, seqs)
        starts: dict[int, int] = {}
        base = 0
        for piece_starts, h in pieces:
            starts.update((i, base + at) for i, at in piece_starts.items())
            base += h.shape[0]
        flat = torch.cat([h for _, h in pieces]) if len(pieces) > 1 else pieces[0][1]
        return flat, starts

    def chunks(self, seqs: list[Sequence]) -> list[list[Sequence]]:
        """``seqs`` in admission order, cut into runs of at most ``max_prefill_tokens`` prompt tokens."""
        chunks: list[list[Sequence]] = []
        tokens = 0
        for seq in seqs:
            if not chunks or tokens + seq.prompt_len > self.max_prefill_tokens:
                chunks.append([])
                tokens = 0
            chunks[-1].append(seq)
            tokens += seq.prompt_len
        return chunks

    def embed_prompts(self, seqs: list[Sequence]) -> torch.Tensor:
        """The input embeddings ``[sum of prompt_len, hidden]`` of the prompts of ``seqs``, one after
        another (text, speaker, voice-sample codes): built on the host, one lookup for all, and no
        device value read back."""
        total = sum(s.prompt_len for s in seqs)
        ids = torch.zeros(total, self.num_vq, dtype=torch.long)
        text_mask = torch.zeros(total, dtype=torch.bool)
        speaker_at: list[int] = []
        speakers: list[torch.Tensor] = []
        start = 0
        for seq in seqs:
            inp: SeqInputs = seq.payload
            n_text = len(inp.ids)
            ids[start : start + n_text] = torch.tensor(inp.ids, dtype=torch.long)[:, None]
            if inp.prompt_codes is not None:
                ids[start + n_text : start + seq.prompt_len] = inp.prompt_codes.to(torch.long)
            text_mask[start : start + n_text] = True
            if inp.speaker is not None:
                # The [spk_emb] text positions take the speaker embedding instead of the token's.
                at = [start + i for i, t in enumerate(inp.ids) if t == inp.speaker_token_id]
                speaker_at += at
                speakers += [inp.speaker] * len(at)
            start += seq.prompt_len
        emb = self.model.embed.embed_prompt(self._to_device(ids)[None], self._to_device(text_mask)[None])[0]
        if speaker_at:
            emb[self._to_device(torch.tensor(speaker_at))] = torch.stack(speakers).to(emb.device, emb.dtype)
        return emb


def torch_prefill(pf: Prefiller, seqs: list[Sequence]) -> Pieces:
    """Prompts packed into calls of at most ``max_prefill_tokens`` tokens."""
    pieces = []
    for chunk in pf.chunks(seqs):
        lengths = [s.prompt_len for s in chunk]
        emb = pf.embed_prompts(chunk).to(pf.dtype)
        slots = [s.slot for s in chunk]
        h = prefill_prompts(pf.model.gpt, emb, pf.cache, slots, lengths, pf.pad_rows_to).float()
        starts = np.cumsum([0, *lengths[:-1]]).tolist()
        pieces.append((dict(zip((s.seq_id for s in chunk), starts, strict=True)), h))
    return pieces


def onnx_prefill(pf: Prefiller, seqs: list[Sequence]) -> Pieces:
    """One ORT call per run of consecutive slots, rows right-padded to the run's longest prompt
    (padding is zeros: it never enters a row's keys, and int8's per-call activation scale does not
    see it); each call's output flattened to ``[run * longest, hidden]``."""
    by_slot = sorted(seqs, key=lambda s: s.slot)
    runs: list[list[Sequence]] = []
    for seq in by_slot:
        if runs and seq.slot == runs[-1][-1].slot + 1:
            runs[-1].append(seq)
        else:
            runs.append([seq])
    pieces = []
    for run in runs:
        lens = np.array([s.prompt_len for s in run], dtype=np.int32)
        width = int(lens.max())
        x = torch.zeros(len(run), width, pf.model.embed.emb_text.weight.shape[1], device=pf.device)
        for b, seq in enumerate(run):
            x[b, : seq.prompt_len] = pf.embed_prompts([seq])
        h = pf.trunk.run(x, pf.cache, run[0].slot, lens - 1, lens)
        pieces.append(({s.seq_id: b * width for b, s in enumerate(run)}, h.reshape(-1, h.shape[-1])))
    return pieces
