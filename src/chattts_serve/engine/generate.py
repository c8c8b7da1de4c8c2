"""Batched GPT generation over a static KV cache: prefill the (left-padded) prompts, then decode one
step at a time until every sequence has stopped.

Used for both passes: ``mode="text"`` (refine_text: text head, one id per step, EOS = [Ebreak]) and
``mode="code"`` (infer_code: 4 audio heads, 4 codes per step, EOS = 625 on any codebook). Each sequence
is sampled with its own parameters and its own generator, so a sequence's result does not depend on
the others' sampling; at batch 1 in fp32 the draws equal the reference's exactly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch
from tqdm import tqdm

from ..model.checkpoint import LoadedModel
from ..model.config import AUDIO_EOS
from .sampler import process_logits, sample

logger = logging.getLogger(__name__)

Mode = Literal["text", "code"]
MAX_EMPTY_RETRIES = 8


@dataclass(frozen=True, slots=True)
class StepSampling:
    """Sampling settings of one sequence for one pass."""

    temperature: tuple[float, ...]  # 1 value (text) or one per codebook (code)
    top_p: float
    top_k: int
    repetition_penalty: float
    min_new_tokens: int
    max_new_tokens: int
    seed: int | None
    ensure_non_empty: bool = True


@dataclass(slots=True)
class GenRequest:
    ids: list[int]  # prompt token ids (text positions)
    sampling: StepSampling
    speaker: torch.Tensor | None = None  # [hidden] normalized embedding, replaces the [spk_emb] row
    speaker_token_id: int | None = None
    prompt_codes: torch.Tensor | None = None  # [T_s, 4] audio sample appended after the text


@dataclass(slots=True)
class GenOutput:
    ids: torch.Tensor  # [T] text ids or [T, 4] codes (EOS step excluded)
    hiddens: torch.Tensor | None  # [T, hidden] fp32 (code mode): hidden state that predicted each step
    finish_reason: Literal["stop", "length", "empty"]


class _RowSampler:
    """Sampling state of one sequence: its generator and generated history."""

    def __init__(self, s: StepSampling, num_rows: int, device: torch.device) -> None:
        self.s = s
        self.generator = torch.Generator(device=device)
        if s.seed is None:
            # Drawn from the global RNG, so torch.manual_seed() still makes unseeded runs repeatable.
            self.generator.manual_seed(int(torch.randint(0, 2**62, (1,)).item()))
        self.temperature = torch.tensor(s.temperature, dtype=torch.float32, device=device).view(-1, 1)
        if self.temperature.shape[0] != num_rows:
            self.temperature = self.temperature.expand(num_rows, 1)

    def draw(self, logits: torch.Tensor, history: torch.Tensor, step: int, eos_id: int) -> torch.Tensor:
        probs = process_logits(
            logits,
            history,
            temperature=self.temperature,
            repetition_penalty=self.s.repetition_penalty,
            top_p=self.s.top_p,
            top_k=self.s.top_k,
            block_eos_id=eos_id if step < self.s.min_new_tokens else None,
        )
        if self.s.seed is not None:
            self.generator.manual_seed(self.s.seed)  # reference semantics: re-seeded before every step
        return sample(probs, self.generator)


@torch.inference_mode()
def generate(
    model: LoadedModel,
    requests: list[GenRequest],
    mode: Mode,
    eos_id: int | None = None,
    progress: bool = False,
) -> list[GenOutput]:
    if not requests:
        return []
    outputs = _generate_once(model, requests, mode, eos_id, progress)
    for attempt in range(MAX_EMPTY_RETRIES):
        retry = [
            i
            for i, (r, o) in enumerate(zip(requests, outputs, strict=True))
            if o.finish_reason == "empty" and r.sampling.seed is None and r.sampling.ensure_non_empty
        ]
        if not retry:
            break
        logger.warning("sequence(s) %s ended at step 0; generating again (attempt %d)", retry, attempt + 1)
        again = _generate_once(model, [requests[i] for i in retry], mode, eos_id, progress)
        for i, o in zip(retry, again, strict=True):
            outputs[i] = o
    return outputs


def _generate_once(
    model: LoadedModel, requests: list[GenRequest], mode: Mode, eos_id: int | None, progress: bool
) -> list[GenOutput]:
    gpt, embed = model.gpt, model.embed
    device = embed.emb_text.weight.device
    gpt_dtype = gpt.norm.weight.dtype
    num_vq = embed.num_vq
    code_mode = mode == "code"
    eos = AUDIO_EOS if code_mode else eos_id
    if eos is None:
        raise ValueError("text mode needs eos_id")
    bsz = len(requests)
    lens = [len(r.ids) + (0 if r.prompt_codes is None else len(r.prompt_codes)) for r in requests]
    plen = max(lens)
    max_new = max(r.sampling.max_new_tokens for r in requests)

    # Left-padded prompt: [B, T, 4] ids (text ids repeated 4x), text mask, validity mask.
    input_ids = torch.zeros(bsz, plen, num_vq, dtype=torch.long)
    text_mask = torch.zeros(bsz, plen, dtype=torch.bool)
    valid = torch.zeros(bsz, plen + max_new, dtype=torch.bool)
    valid[:, plen:] = True
    for b, (r, n) in enumerate(zip(requests, lens, strict=True)):
        off = plen - n
        ids = torch.tensor(r.ids, dtype=torch.long)
        input_ids[b, off : off + len(ids)] = ids[:, None]
        text_mask[b, off : off + len(ids)] = True
        if r.prompt_codes is not None:
            input_ids[b, off + len(ids) : plen] = r.prompt_codes.to(torch.long)
        valid[b, off:plen] = True
    input_ids, text_mask, valid = input_ids.to(device), text_mask.to(device), valid.to(device)

    emb = embed.embed_prompt(input_ids, text_mask)
    for b, r in enumerate(requests):
        if r.speaker is not None:
            emb[b, input_ids[b, :, 0].eq(r.speaker_token_id) & text_mask[b]] = r.speaker.to(emb.dtype)

    padded = any(n != plen for n in lens)
    positions = (valid[:, :plen].long().cumsum(-1) - 1).masked_fill(~valid[:, :plen], 1)
    cache = gpt.new_cache(bsz, plen + max_new)
    slots = torch.arange(bsz, device=device)
    mask = _prefill_mask(valid[:, :plen]) if padded else None
    hidden = gpt(emb.to(gpt_dtype), positions, cache, slots, 0, mask).float()  # [B, hidden]

    samplers = [_RowSampler(r.sampling, num_vq if code_mode else 1, device) for r in requests]
    history = torch.zeros(bsz, num_vq if code_mode else 1, max_new, dtype=torch.long, device=device)
    hiddens = torch.zeros(bsz, max_new, hidden.shape[-1], dtype=torch.float32, device=device) if code_mode else None
    num_out = [0] * bsz
    done: list[str | None] = [None] * bsz
    next_pos = torch.tensor(lens, dtype=torch.long, device=device)
    bar = tqdm(total=max_new, desc=mode, disable=not progress, leave=False)

    for step in range(max_new):
        logits = embed.code_logits(hidden) if code_mode else embed.text_logits(hidden)
        rows = logits.view(bsz, -1, logits.shape[-1])  # [B, 4 or 1, V]
        new_tokens = torch.zeros(bsz, num_vq if code_mode else 1, dtype=torch.long, device=device)
        for b in range(bsz):
            if done[b] is not None:
                continue
            s = samplers[b]
            drawn = s.draw(rows[b], history[b, :, :step], step, eos)  # [4] or [1]
            new_tokens[b] = drawn
            if bool((drawn == eos).any()):
                done[b] = "empty" if step == 0 else "stop"
                continue
            history[b, :, step] = drawn
            if code_mode:
                hiddens[b, step] = hidden[b]
            num_out[b] = step + 1
            if num_out[b] >= s.s.max_new_tokens:
                done[b] = "length"
        bar.update(1)
        if all(d is not None for d in done):
            break
        # Next input: every row feeds its sampled token (finished rows too; their results are ignored).
        step_emb = embed.embed_codes(new_tokens[:, None, :]) if code_mode else embed.embed_text(new_tokens)
        pos = (next_pos + step)[:, None]
        start = plen + step
        step_mask = valid[:, None, None, : start + 1] if padded else None
        hidden = gpt(step_emb.to(gpt_dtype), pos, cache, slots, start, step_mask).float()
    bar.close()

    outs = []
    for b in range(bsz):
        n = num_out[b]
        reason = done[b] or "length"
        if reason == "length" and requests[b].sampling.min_new_tokens < n:
            logger.warning("sequence %d hit max_new_tokens (%d)", b, n)
        ids = history[b, :, :n].t().cpu() if code_mode else history[b, 0, :n].cpu()
        outs.append(GenOutput(ids, hiddens[b, :n].cpu() if code_mode else None, reason))
    return outs


def _prefill_mask(valid: torch.Tensor) -> torch.Tensor:
    """[B, T] validity -> [B, 1, T, T] bool: causal, no padding keys; padding queries see only themselves
    (their outputs are never used, but must stay finite)."""
    t = valid.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=valid.device).tril()
    mask = causal[None] & valid[:, None, :]
    return (mask | torch.eye(t, dtype=torch.bool, device=valid.device)[None])[:, None]
