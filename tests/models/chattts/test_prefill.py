"""models/chattts/prefill.py: several whole prompts packed into one trunk call. In every layout that
keeps a matmul row's result independent of the row count (models/chattts/prepare.py), each prompt's hidden states
and cache are bit-identical to its prefill alone; padding and neighbours never reach a prompt's keys."""

from __future__ import annotations

import pytest
import torch

from chattts_serve.kernels import int4_decode, kv_int8
from chattts_serve.kernels.quant import parse_precision, record_absmax
from chattts_serve.models.chattts import checkpoint, prefill
from chattts_serve.models.chattts.config import GPTConfig
from chattts_serve.models.chattts.gpt import (
    INT4_MLP_ROW_BLOCK,
    Attention,
    KVCache,
    rope_cos_sin,
    rope_inv_freq,
    rotate_half,
)
from chattts_serve.models.chattts.prefill import prefill_prompts
from chattts_serve.models.chattts.prepare import ModelLayout, prepare_model

LENGTHS = [9, 23, 2, 40, 5]  # mixed, one shorter than the 4 rows the padded layout rounds to
SLOTS = [4, 0, 3, 1, 2]  # not in order: each prompt goes to its own slot wherever it is
MAX_LEN = 48
SENTINEL = 7.0  # what a slot held before: must survive past each prompt's length


def _prepared(tiny_ckpt, precision: str, slots: int, compile: bool = False) -> tuple:
    model = checkpoint.load(tiny_ckpt)
    hidden = model.config.gpt.hidden_size

    def calibrate(m):  # int8-static: activation ranges from one fp32 pass over random prompts
        x = torch.randn(1, 16, hidden, generator=torch.Generator().manual_seed(9))
        return record_absmax(
            m.gpt, lambda: m.gpt(x, torch.arange(16)[None], m.gpt.new_cache(1, 16), torch.tensor([0]), 0)
        )

    with torch.inference_mode():
        layout = prepare_model(model, parse_precision(precision), slots, compile=compile, calibrate=calibrate)
    return model, layout


def _prompts(model) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    dtype = model.gpt.norm.weight.dtype
    return [torch.randn(n, model.config.gpt.hidden_size, generator=gen).to(dtype) for n in LENGTHS]


def _cache(gpt, kv_dtype=None):
    cache = gpt.new_cache(len(LENGTHS) + 1, MAX_LEN, dtype=kv_dtype)
    for t in (cache.k, cache.v, cache.k_scale, cache.v_scale):  # int8: its scales too
        if t is not None:
            t.fill_(SENTINEL)
    return cache


def _together_and_alone(model, layout: ModelLayout, kv_dtype=None):
    gpt, prompts = model.gpt, _prompts(model)
    with torch.inference_mode():
        cache = _cache(gpt, kv_dtype)
        together = prefill_prompts(gpt, torch.cat(prompts), cache, SLOTS, LENGTHS, layout.pad_rows_to).split(LENGTHS)
        alone = []
        for slot, emb in zip(SLOTS, prompts, strict=True):
            single = _cache(gpt, kv_dtype)
            alone.append((prefill_prompts(gpt, emb, single, [slot], [len(emb)], layout.pad_rows_to), single))
    return prompts, together, cache, alone


# (precision, kv cache dtype, compile): the layouts a multi-slot engine runs in
INVARIANT = [
    ("fp32", None, False),  # oneDNN-packed weights
    ("fp32", None, True),  # compile: no packing, fp32 matmuls on a multiple of 4 rows
    ("fp32", torch.bfloat16, False),  # bf16 KV cache: the prompt reads its keys rounded, as forward
    ("fp32", torch.int8, False),  # int8 KV cache: each vector quantized alone, the prompt reads them dequantized
    ("int8-static", torch.int8, False),
    ("bf16", None, False),
    ("int8", None, False),  # weight-only int8 (bf16 activations)
    ("int8-static", None, False),  # one calibrated activation scale per layer
]


@pytest.mark.parametrize("precision,kv_dtype,compile", INVARIANT)
def test_packed_prompts_equal_each_alone_bit_exactly(tiny_ckpt, precision, kv_dtype, compile):
    model, layout = _prepared(tiny_ckpt, precision, len(LENGTHS) + 1, compile)
    assert layout.packed != compile and layout.pad_rows_to == (4 if compile else 1)
    _, together, cache, alone = _together_and_alone(model, layout, kv_dtype)
    for slot, n, h, (h_alone, single) in zip(SLOTS, LENGTHS, together, alone, strict=True):
        assert torch.equal(h, h_alone), (precision, n)
        for kv, kv_alone in _cache_pairs(cache, single):
            assert torch.equal(kv[:, slot, :, :n], kv_alone[:, slot, :, :n])
            assert (kv[:, slot, :, n:] == SENTINEL).all(), "nothing past a prompt's length is written"
    spare = len(LENGTHS)  # a slot no prompt went to
    assert (cache.k[:, spare] == SENTINEL).all() and (cache.v[:, spare] == SENTINEL).all()


def _cache_pairs(a, b) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The buffers of two caches side by side: keys, values and, int8, their scales."""
    pairs = [(a.k, b.k), (a.v, b.v)]
    if a.quantized:
        pairs += [(a.k_scale, b.k_scale), (a.v_scale, b.v_scale)]
    return pairs


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8])
def test_int4_prefill_is_its_decode_step_fed_token_by_token(tiny_ckpt, kv_dtype, monkeypatch):
    """int4 over a bf16/int8 cache prefills through its C++ decode step: every token's hidden state and key are
    the ones decode steps fed the prompts one token at a time give, to the bit, whether the packed tokens run in
    row blocks (16: the 79 tokens in five) or in one (on two threads), and chunked at a cut no block aligns with."""
    model, _ = _prepared(tiny_ckpt, "int4", len(LENGTHS) + 1)
    gpt, prompts = model.gpt, _prompts(model)
    if gpt.fused_decode is None:
        pytest.skip("the int4 C++ step does not run here (no AVX-512 VNNI or no compiler)")

    def packed() -> tuple[list[torch.Tensor], KVCache]:
        cache = _cache(gpt, kv_dtype)
        return prefill_prompts(gpt, torch.cat(prompts), cache, SLOTS, LENGTHS).split(LENGTHS), cache

    with torch.inference_mode():
        monkeypatch.setattr(int4_decode, "ROW_BLOCK", 16)
        blocked, blocked_cache = packed()
        stepped_cache, stepped = _cache(gpt, kv_dtype), [[] for _ in prompts]
        for t in range(max(LENGTHS)):  # step t: token t of every prompt that long, at position t
            live = [b for b, n in enumerate(LENGTHS) if n > t]
            emb = torch.stack([prompts[b][t] for b in live])
            for b, h in zip(
                live, gpt.decode(emb, stepped_cache, [SLOTS[b] for b in live], [t] * len(live)), strict=True
            ):
                stepped[b].append(h)
        cut, chunk_cache = 7, _cache(gpt, kv_dtype)
        first = prefill_prompts(
            gpt, torch.cat([p[:cut] for p in prompts]), chunk_cache, SLOTS, [min(cut, n) for n in LENGTHS]
        )
        rest = [b for b, n in enumerate(LENGTHS) if n > cut]
        lens = [LENGTHS[b] - cut for b in rest]
        later = prefill_prompts(
            gpt,
            torch.cat([prompts[b][cut:] for b in rest]),
            chunk_cache,
            [SLOTS[b] for b in rest],
            lens,
            1,
            [cut] * len(rest),
        )
        monkeypatch.setattr(int4_decode, "ROW_BLOCK", 128)
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            whole, whole_cache = packed()
        finally:
            torch.set_num_threads(threads)
    chunked = dict(zip(range(len(LENGTHS)), first.split([min(cut, n) for n in LENGTHS]), strict=True))
    for b, part in zip(rest, later.split(lens), strict=True):
        chunked[b] = torch.cat([chunked[b], part])
    for b, n in enumerate(LENGTHS):
        for other in (torch.stack(stepped[b]), whole[b], chunked[b]):
            assert torch.equal(blocked[b], other), (b, n)
    for cache in (stepped_cache, whole_cache, chunk_cache):
        for kv, kv_blocked in _cache_pairs(cache, blocked_cache):
            assert torch.equal(kv, kv_blocked)  # slot by slot: each prompt's positions, then untouched SENTINELs
    slot, n = SLOTS[0], LENGTHS[0]
    assert (blocked_cache.k[:, slot, :, n:] == SENTINEL).all() and (blocked_cache.k[:, slot, :, :n] != SENTINEL).any()


def test_int4_mlp_in_row_blocks_changes_no_bit(tiny_ckpt):
    model, layout = _prepared(tiny_ckpt, "int4", len(LENGTHS) + 1)
    mlps = [layer.mlp for layer in model.gpt.layers]
    if model.gpt.fused_decode is None:  # no C++ GEMV: the dense fallback's matmul keeps whole calls
        assert all(m.row_block == 0 for m in mlps)
        pytest.skip("the int4 GEMV does not run here (no AVX-512 VNNI or no compiler)")
    assert all(m.row_block == INT4_MLP_ROW_BLOCK for m in mlps)
    widths = []
    swiglu = mlps[0]._swiglu
    mlps[0]._swiglu = lambda x: (widths.append(x.shape[0]), swiglu(x))[1]
    for m in mlps:
        m.row_block = 16  # the 79 packed tokens in five blocks, the last one partial
    _, blocked, blocked_cache, alone = _together_and_alone(model, layout)
    assert widths[:5] == [16, 16, 16, 16, 15]
    for m in mlps:
        m.row_block = 0
    _, whole, whole_cache, _ = _together_and_alone(model, layout)
    for h, h_whole, (h_alone, _) in zip(blocked, whole, alone, strict=True):
        assert torch.equal(h, h_whole) and torch.equal(h, h_alone)
    for kv, kv_whole in _cache_pairs(blocked_cache, whole_cache):
        assert torch.equal(kv, kv_whole)


@pytest.mark.parametrize(
    "precision,kv_dtype", [("fp32", None), ("bf16", None), ("int8-static", None), ("int8-static", torch.int8)]
)
def test_packed_layout_prefill_equals_forward(tiny_ckpt, precision, kv_dtype):
    """With packed weights the batched prefill is what the per-sequence ``forward`` gave (the
    runner's path before the prompts were batched), prompt by prompt (an int8 cache: both write the same
    bytes and read them back dequantized)."""
    model, layout = _prepared(tiny_ckpt, precision, len(LENGTHS) + 1)
    prompts, together, _, _ = _together_and_alone(model, layout, kv_dtype)
    with torch.inference_mode():
        for slot, emb, h in zip(SLOTS, prompts, together, strict=True):
            cache = _cache(model.gpt, kv_dtype)
            n = len(emb)
            ref = model.gpt(emb[None], torch.arange(n)[None], cache, torch.tensor([slot]), 0, None, last_only=False)
            assert torch.equal(h, ref[0]), (precision, n)


def test_one_slot_fp32_prefill_is_forward_bit_exactly(tiny_ckpt):
    """The reference-exact layout (one slot, fp32, nothing prepared): one prompt through ``prefill_prompts``
    runs every matmul on the rows ``forward`` uses, so hidden states and keys are bit-identical (the
    fidelity tests then hold the result to chattts itself)."""
    model, layout = _prepared(tiny_ckpt, "fp32", 1)
    assert not layout.packed and layout.pad_rows_to == 1
    gpt = model.gpt
    with torch.inference_mode():
        for emb in _prompts(model):
            n = len(emb)
            a, b = gpt.new_cache(1, MAX_LEN), gpt.new_cache(1, MAX_LEN)
            ref = gpt(emb[None], torch.arange(n)[None], a, torch.tensor([0]), 0, None, last_only=False)[0]
            assert torch.equal(prefill_prompts(gpt, emb, b, [0], [n]), ref), n
            assert torch.equal(a.k[:, :, :, :n], b.k[:, :, :, :n]) and torch.equal(a.v[:, :, :, :n], b.v[:, :, :, :n])


def test_int8_dynamic_batched_prefill_stays_within_its_quantisation_error(tiny_ckpt):
    """int8-dynamic takes one activation scale per call from all its rows, so a prompt's result
    depends on its neighbours (documented: not batch-invariant). Batched, it stays about as close to
    fp32 as alone (~2-3 % relative on the tiny checkpoint), never far off."""
    model, layout = _prepared(tiny_ckpt, "int8-dynamic", len(LENGTHS) + 1)
    _, together, _, alone = _together_and_alone(model, layout)
    ref_model, ref_layout = _prepared(tiny_ckpt, "fp32", len(LENGTHS) + 1)
    _, _, _, ref = _together_and_alone(ref_model, ref_layout)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    assert not all(torch.equal(h, a) for h, (a, _) in zip(together, alone, strict=True))
    for h, (a, _), (r, _) in zip(together, alone, ref, strict=True):
        assert rel(a, r) < 0.05 and rel(h, r) < 0.05 and rel(h, r) < 2 * rel(a, r) + 0.01


def test_bad_prefill_arguments_are_refused(tiny_ckpt):
    model, _ = _prepared(tiny_ckpt, "fp32", 2)
    gpt, hidden = model.gpt, model.config.gpt.hidden_size
    cache = gpt.new_cache(2, 8)
    with torch.inference_mode():
        with pytest.raises(ValueError, match="one length >= 1 per slot"):
            prefill_prompts(gpt, torch.zeros(3, hidden), cache, [0, 1], [3])
        with pytest.raises(ValueError, match="one length >= 1 per slot"):
            prefill_prompts(gpt, torch.zeros(3, hidden), cache, [0, 1], [3, 0])
        with pytest.raises(ValueError, match="sum to 5 but embeds has 3 rows"):
            prefill_prompts(gpt, torch.zeros(3, hidden), cache, [0, 1], [3, 2])
        with pytest.raises(ValueError, match=r"its own slot; got \[1, 1\]"):
            prefill_prompts(gpt, torch.zeros(3, hidden), cache, [1, 1], [1, 2])
        with pytest.raises(ValueError, match="prompt of 9 positions exceeds cache 8"):
            prefill_prompts(gpt, torch.zeros(9, hidden), cache, [0], [9])


# ------------------------------------------------------------------ chunked prefill

CHUNKED_LENGTHS = [150, 64, 97]  # several blocks and a part; exactly one; one and a part
BLOCK = 64


def _chunked_and_one_shot(model, layout, kv_dtype=None, chunk: int = BLOCK):
    """Each prompt prefilled in one call and in chunks of ``chunk`` positions (each chunk its own call, the
    chunks of all prompts side by side), both with the attention in query blocks of ``BLOCK``."""
    gpt, hidden = model.gpt, model.config.gpt.hidden_size
    gen = torch.Generator().manual_seed(4)
    dtype = gpt.norm.weight.dtype
    prompts = [torch.randn(n, hidden, generator=gen).to(dtype) for n in CHUNKED_LENGTHS]
    slots = list(range(len(prompts)))
    pad = layout.pad_rows_to
    with torch.inference_mode():
        one_cache = gpt.new_cache(len(prompts), 200, dtype=kv_dtype)
        one = prefill_prompts(gpt, torch.cat(prompts), one_cache, slots, CHUNKED_LENGTHS, pad, block=BLOCK)
        one = one.split(CHUNKED_LENGTHS)
        cache = gpt.new_cache(len(prompts), 200, dtype=kv_dtype)
        cache.k.fill_(SENTINEL), cache.v.fill_(SENTINEL)
        pieces: list[list[torch.Tensor]] = [[] for _ in prompts]
        for start in range(0, max(CHUNKED_LENGTHS), chunk):
            live = [b for b, n in enumerate(CHUNKED_LENGTHS) if n > start]
            lens = [min(chunk, CHUNKED_LENGTHS[b] - start) for b in live]
            emb = torch.cat([prompts[b][start : start + n] for b, n in zip(live, lens, strict=True)])
            h = prefill_prompts(gpt, emb, cache, live, lens, pad, [start] * len(live), BLOCK).split(lens)
            for b, part in zip(live, h, strict=True):
                pieces[b].append(part)
    return [torch.cat(p) for p in pieces], one, cache, one_cache


@pytest.mark.parametrize("precision,kv_dtype,compile", INVARIANT)
def test_chunked_prefill_equals_one_shot_bit_exactly(tiny_ckpt, precision, kv_dtype, compile):
    """A prompt prefilled in chunks (each writing after the keys the earlier ones cached, and attending to
    them) gives the hidden states and keys of its one-shot prefill, to the bit: the attention runs in the
    same query blocks either way, and the matmul rows are independent in these layouts."""
    model, layout = _prepared(tiny_ckpt, precision, len(LENGTHS) + 1, compile)
    for chunk in (BLOCK, 2 * BLOCK):
        chunked, one, cache, one_cache = _chunked_and_one_shot(model, layout, kv_dtype, chunk)
        for b, n in enumerate(CHUNKED_LENGTHS):
            assert torch.equal(chunked[b], one[b]), (precision, n, chunk)
            for kv, kv_one in ((cache.k, one_cache.k), (cache.v, one_cache.v)):
                assert torch.equal(kv[:, b, :, :n], kv_one[:, b, :, :n])
                assert (kv[:, b, :, n:] == SENTINEL).all(), "nothing past a prompt's length is written"


def test_blocked_attention_matches_forward_closely_and_refuses_unaligned_chunks(tiny_ckpt):
    """The query-blocked attention is causal attention (as ``forward``'s, up to float rounding); a chunk that
    does not start at a block boundary would make other calls than the one-shot prefill: refused."""
    model, layout = _prepared(tiny_ckpt, "fp32", 2)
    gpt, n = model.gpt, 150
    emb = torch.randn(n, model.config.gpt.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        blocked = prefill_prompts(gpt, emb, gpt.new_cache(1, 200), [0], [n], block=BLOCK)
        ref = gpt(emb[None], torch.arange(n)[None], gpt.new_cache(1, 200), torch.tensor([0]), 0, None, last_only=False)
        torch.testing.assert_close(blocked, ref[0], rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="multiple of the attention block 64; got 32"):
            prefill_prompts(gpt, emb[:32], gpt.new_cache(1, 200), [0], [32], starts=[32], block=BLOCK)
        # Without blocks a later chunk still attends to every earlier key (the same function, not its bits).
        cache = gpt.new_cache(1, 200)
        first = prefill_prompts(gpt, emb[:100], cache, [0], [100])
        rest = prefill_prompts(gpt, emb[100:], cache, [0], [n - 100], starts=[100])
        torch.testing.assert_close(torch.cat([first, rest]), ref[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("first,block", [(0, 0), (0, 16), (32, 16)])
def test_prefill_attention_over_an_int8_cache_matches_float64(first, block):
    """The prompt's attention over an int8 cache (``prefill._attend``), one chunk at ``first`` after earlier
    positions already cached, against float64 attention over the dequantized keys and values: the keys the
    prompt sees are the int8 ones the decode steps will read, and the rest is fp32 rounding."""
    cfg = GPTConfig(hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=96)
    attn = Attention(cfg, 0).eval()
    torch.nn.init.eye_(attn.o_proj.weight)  # the attention output itself
    gen = torch.Generator().manual_seed(5)
    n, slot, hd = 40, 1, cfg.head_dim
    cache = KVCache(1, 3, cfg.num_kv_heads, first + n, hd, torch.int8, "cpu")
    if first:  # the earlier chunk's keys and values, written as its own call wrote them
        k0 = torch.randn(first, cfg.num_kv_heads, hd, generator=gen)
        v0 = torch.randn(first, cfg.num_kv_heads, hd, generator=gen)
        cache.write(0, (torch.full((first,), slot), slice(None), torch.arange(first)), k0, v0)
    x = torch.randn(n, cfg.hidden_size, generator=gen)
    pos = torch.arange(first, first + n)
    cos, sin = rope_cos_sin(pos, rope_inv_freq(hd, cfg.rope_theta), torch.float32)
    where = (torch.full((n,), slot), pos)
    with torch.inference_mode():
        out = prefill._attend(attn, x, cos[:, None], sin[:, None], cache, [slot], [n], [first], block, where)
        q = attn.q_proj(x).reshape(n, cfg.num_heads, hd)
        q = q * cos[:, None] + rotate_half(q) * sin[:, None]
    keys = kv_int8.dequantize(cache.k[0, slot, :, : first + n], cache.k_scale[0, slot, :, : first + n]).double()
    values = kv_int8.dequantize(cache.v[0, slot, :, : first + n], cache.v_scale[0, slot, :, : first + n]).double()
    rep = cfg.num_heads // cfg.num_kv_heads
    keys, values = keys.repeat_interleave(rep, 0), values.repeat_interleave(rep, 0)
    scores = torch.einsum("thd,hpd->htp", q.double(), keys) * hd**-0.5
    causal = torch.arange(first + n)[None, :] <= pos[:, None]
    weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    want = torch.einsum("htp,hpd->thd", weights, values).reshape(n, -1).float()
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
    # and the int8 keys are the fp32 keys within half a step
    k = attn.k_proj(x).reshape(n, cfg.num_kv_heads, hd)
    k = (k * cos[:, None] + rotate_half(k) * sin[:, None]).transpose(0, 1)
    err = (keys[::rep, first:].float() - k).abs()
    assert (err <= cache.k_scale[0, slot, :, first : first + n, None] / 2 + 1e-6).all()
