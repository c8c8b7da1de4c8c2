"""Prefill for the model runner: the prompts admitted in a step into their KV slots, then each prompt's
last hidden state and first logits, batched per kind. A step's prompt pieces are ``PrefillChunk``s: whole
prompts, or (chunked prefill, ``engine.scheduler``) chunks of a long one over several steps, each written
after the keys the earlier ones left in the slot; the heads run on a prompt's last chunk only.

Trunk. How the prompts go through the trunk is the decode path's (``DecodePath.prefill``: one of the two
functions here, or a new backend's own). Torch modes (``torch_prefill``): the prompts go through the trunk
together, packed one after another (``models.chattts.prefill``: the projections on all their tokens at once,
attention prompt by prompt; ``int4`` on its C++ step: every token a row of the step), in calls of at most
``max_prefill_tokens`` tokens; a prompt's result is the one it gets alone wherever the layout keeps matmul
rows independent (every mode but int8-dynamic; see ``models.chattts.prepare``). ``ort-*`` modes
(``onnx_prefill``): the prompts of sequences in consecutive slots go in one ONNX Runtime call, right-padded to
the longest (``query_seqlens`` tells the op each row's length). Either way a burst of 32 admissions is one
call, not 32, each of which would stream all the weights once.

Chunks. A chunked prompt's hidden states and keys are bit-identical to its one-shot prefill's: the torch modes
run its attention in query blocks of ``block`` positions counted from 0, one SDPA call each, and the scheduler
cuts chunks at multiples of ``block``, so a chunked prompt makes exactly the attention calls its one-shot
prefill makes (SDPA's CPU kernel blocks its sums by the call's shape, so one call over a chunk would differ
from the one-shot call in the last bits); its matmul rows are independent wherever a prompt's result is
(above). ``int4`` on its C++ step computes each token alone: any cut gives the same bits. With ``block`` 0
(one slot, the reference-exact layout: nothing decodes beside a prompt, so nothing is chunked) a prompt's
attention is the one call the reference makes. ONNX Runtime's GroupQueryAttention appends a chunk after the
cached positions (``query_seqlens``) and computes each query row alone: the same bits as one call
(``tests/engine/test_chunked_prefill.py``).

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
from .outputs import PrefillChunk
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
"""A prefill's trunk output: pieces of (seq id -> the row of its chunk's last position, final-norm hidden states
``[rows, hidden]`` fp32). Asked for the last rows only (``last_only``), a path may return just those: the rows
before a chunk's last are then not in its piece."""


def whole(seqs: list[Sequence]) -> list[PrefillChunk]:
    """Each sequence's whole prompt as one chunk."""
    return [PrefillChunk(s, 0, s.prompt_len) for s in seqs]


class Prefiller:
    def __init__(
        self,
        model: LoadedModel,
        cache,
        trunk,
        pad_rows_to: int,
        max_prefill_tokens: int,
        trunk_rows: Callable[[Prefiller, list[PrefillChunk], bool], Pieces],
        block: int = 0,
    ) -> None:
        """``trunk``: the ``ort-*`` session (None in the torch modes); ``cache``: the runner's slot cache;
        ``trunk_rows``: how the prompt chunks go through the trunk (the decode path's ``prefill``; its flag: only
        each chunk's last row is needed); ``block``: the torch prefill attention's query block (module docstring;
        ``SchedulerConfig.prefill_chunk``; 0: one call per prompt)."""
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens!r}")
        self.model, self.cache, self.trunk, self.trunk_rows = model, cache, trunk, trunk_rows
        self.pad_rows_to, self.max_prefill_tokens, self.block = pad_rows_to, max_prefill_tokens, block
        self.device = model.embed.emb_text.weight.device
        self.dtype = model.gpt.norm.weight.dtype
        self.num_vq = model.config.gpt.num_vq
        self.last_rows_heads = model.embed.heads_packed or self.device.type != "cpu"
        """The heads see only each prompt's last row, all prompts of a kind at once (module docstring)."""

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Host -> device; on CUDA through pinned memory without blocking the host."""
        return pinned_copy(t, self.device)

    def run(self, chunks: list[PrefillChunk]) -> dict[str, KindPrefill]:
        """Prefill ``chunks`` (their sequences' slots assigned): per kind with a last chunk, the last hidden
        states and logits of the sequences whose prompt they complete."""
        # The heads on the last rows: only those are needed (the reference's matmul takes every position).
        flat, lasts = self._trunk_rows(chunks, last_only=self.last_rows_heads)
        lengths = {c.seq.seq_id: c.length for c in chunks}
        embed = self.model.embed
        out: dict[str, KindPrefill] = {}
        for kind in ("code", "text"):
            group = [c.seq for c in chunks if c.last and c.seq.kind == kind]
            if not group:
                continue
            last_at = np.fromiter((lasts[s.seq_id] for s in group), dtype=np.int64, count=len(group))
            last = flat.index_select(0, self._to_device(torch.from_numpy(last_at)))
            if self.last_rows_heads:
                logits = embed.code_logits(last) if kind == "code" else embed.text_logits(last)
            else:  # the reference's matmul: every position of one prompt, the last kept
                parts = []
                for s in group:
                    h = flat[lasts[s.seq_id] + 1 - lengths[s.seq_id] : lasts[s.seq_id] + 1]
                    parts.append(embed.code_logits(h)[-self.num_vq :] if kind == "code" else embed.text_logits(h)[-1:])
                logits = torch.cat(parts) if len(parts) > 1 else parts[0]
            out[kind] = KindPrefill(group, last, logits)
        return out

    def trunk_outputs(self, seqs: list[Sequence]) -> dict[int, torch.Tensor]:
        """Trunk outputs ``[prompt_len, hidden]`` (all positions through the final norm, as the reference
        computes them before taking the last) of every sequence in ``seqs``, by seq id."""
        flat, lasts = self._trunk_rows(whole(seqs), last_only=False)
        return {s.seq_id: flat[lasts[s.seq_id] + 1 - s.prompt_len : lasts[s.seq_id] + 1] for s in seqs}

    def _trunk_rows(self, chunks: list[PrefillChunk], last_only: bool) -> tuple[torch.Tensor, dict[int, int]]:
        """The chunks' trunk outputs in one fp32 tensor ``[rows, hidden]`` (``last_only``: at least each chunk's
        last row), and the row of each chunk's last position."""
        pieces = self.trunk_rows(self, chunks, last_only)
        lasts: dict[int, int] = {}
        base = 0
        for piece_lasts, h in pieces:
            lasts.update((i, base + at) for i, at in piece_lasts.items())
            base += h.shape[0]
        flat = torch.cat([h for _, h in pieces]) if len(pieces) > 1 else pieces[0][1]
        return flat, lasts

    def calls(self, chunks: list[PrefillChunk]) -> list[list[PrefillChunk]]:
        """``chunks`` in order, cut into runs of at most ``max_prefill_tokens`` positions (a longer one alone)."""
        calls: list[list[PrefillChunk]] = []
        tokens = 0
        for chunk in chunks:
            if not calls or tokens + chunk.length > self.max_prefill_tokens:
                calls.append([])
                tokens = 0
            calls[-1].append(chunk)
            tokens += chunk.length
        return calls

    def embed_prompts(self, seqs: list[Sequence]) -> torch.Tensor:
        """``embed_chunks`` of the whole prompts of ``seqs``."""
        return self.embed_chunks(whole(seqs))

    def embed_chunks(self, chunks: list[PrefillChunk]) -> torch.Tensor:
        """The input embeddings ``[sum of lengths, hidden]`` of ``chunks``, one after another (a prompt is its
        text, speaker and voice-sample codes; a chunk its positions of it): built on the host, one lookup
        for all, and no device value read back."""
        total = sum(c.length for c in chunks)
        ids = torch.zeros(total, self.num_vq, dtype=torch.long)
        text_mask = torch.zeros(total, dtype=torch.bool)
        speaker_at: list[int] = []
        speakers: list[torch.Tensor] = []
        at = 0
        for c in chunks:
            inp: SeqInputs = c.seq.payload
            n_text = len(inp.ids)
            t_lo, t_hi = min(c.start, n_text), min(c.end, n_text)  # the chunk's text positions
            ids[at : at + t_hi - t_lo] = torch.tensor(inp.ids[t_lo:t_hi], dtype=torch.long)[:, None]
            text_mask[at : at + t_hi - t_lo] = True
            if inp.prompt_codes is not None and c.end > n_text:  # then its voice-sample codes
                lo = max(c.start, n_text)
                ids[at + lo - c.start : at + c.length] = inp.prompt_codes[lo - n_text : c.end - n_text].to(torch.long)
            if inp.speaker is not None:
                # The [spk_emb] text positions take the speaker embedding instead of the token's.
                hits = [at + i - c.start for i in range(t_lo, t_hi) if inp.ids[i] == inp.speaker_token_id]
                speaker_at += hits
                speakers += [inp.speaker] * len(hits)
            at += c.length
        emb = self.model.embed.embed_prompt(self._to_device(ids)[None], self._to_device(text_mask)[None])[0]
        if speaker_at:
            emb[self._to_device(torch.tensor(speaker_at))] = torch.stack(speakers).to(emb.device, emb.dtype)
        return emb


def torch_prefill(pf: Prefiller, chunks: list[PrefillChunk], last_only: bool = False) -> Pieces:
    """Chunks packed into calls of at most ``max_prefill_tokens`` positions; ``last_only``: each chunk's last
    row alone (``prefill_prompts``' ``out_rows``)."""
    pieces = []
    for call in pf.calls(chunks):
        lengths = [c.length for c in call]
        emb = pf.embed_chunks(call).to(pf.dtype)
        slots = [c.seq.slot for c in call]
        starts = [c.start for c in call]
        lasts = (np.cumsum(lengths) - 1).tolist()
        out_rows = lasts if last_only else None
        h = prefill_prompts(pf.model.gpt, emb, pf.cache, slots, lengths, pf.pad_rows_to, starts, pf.block, out_rows)
        at = range(len(call)) if last_only else lasts
        pieces.append((dict(zip((c.seq.seq_id for c in call), at, strict=True)), h.float()))
    return pieces


def onnx_prefill(pf: Prefiller, chunks: list[PrefillChunk], last_only: bool = False) -> Pieces:
    """One ORT call per run of consecutive slots, rows right-padded to the run's longest chunk
    (padding is zeros: it never enters a row's keys, and int8's per-call activation scale does not
    see it); each call's output flattened to ``[run * longest, hidden]``, every row (``last_only`` unused: the
    graph computes them all). A chunk after the first goes
    to the positions after its slot's cached ones (``seqlens_k``: its end - 1)."""
    by_slot = sorted(chunks, key=lambda c: c.seq.slot)
    runs: list[list[PrefillChunk]] = []
    for chunk in by_slot:
        if runs and chunk.seq.slot == runs[-1][-1].seq.slot + 1:
            runs[-1].append(chunk)
        else:
            runs.append([chunk])
    pieces = []
    for run in runs:
        lens = np.array([c.length for c in run], dtype=np.int32)
        ends = np.array([c.end for c in run], dtype=np.int32)
        width = int(lens.max())
        x = torch.zeros(len(run), width, pf.model.embed.emb_text.weight.shape[1], device=pf.device)
        for b, chunk in enumerate(run):
            x[b, : chunk.length] = pf.embed_chunks([chunk])
        h = pf.trunk.run(x, pf.cache, run[0].seq.slot, ends - 1, lens)
        pieces.append(({c.seq.seq_id: b * width + c.length - 1 for b, c in enumerate(run)}, h.reshape(-1, h.shape[-1])))
    return pieces
