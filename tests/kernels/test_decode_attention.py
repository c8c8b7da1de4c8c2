"""kernels/decode_attention.py: the C++ decode attention over a bf16 (and an int8) slot cache against plain attention,
its batch invariance, and the fallback to torch's SDPA where it cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

from chattts_serve.kernels import cpp_build, kv_int8
from chattts_serve.kernels import decode_attention as da
from chattts_serve.models.chattts.config import GPTConfig
from chattts_serve.models.chattts.gpt import GPT

# The reference reads the same bf16 keys and values and the same fp32 query, in float64; what is left
# is fp32 rounding in the kernel: dots of head_dim products, a sum of up to ~1000 weights and weighted
# values (~sqrt(n) * 6e-8 relative each, outputs of size ~1), and the exp polynomial (< 2e-7 relative).
ATOL = 1e-5
# The int8 op's reference rounds the query to int16 as the op does; what it leaves besides fp32 rounding is
# each block's weights rounded to int16 over their largest: half a step (1/65534 of that weight) on each
# of up to 16 values of |v| <= ~5 here, 1.2e-3 at worst when one block holds the softmax, ~sqrt(16) steps
# of random sign in practice: measured <= 6.1e-5 over these shapes and sharp scores.
ATOL_INT8 = 2e-4


def _kernel_or_skip() -> None:
    if not da.applies(torch.empty(1, 1, 1, 16, dtype=torch.bfloat16)):
        pytest.skip("the decode attention kernel does not run here (no AVX-512 or no compiler)")


def _cache(slots: int, kv_heads: int, positions: int, head_dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(slots, kv_heads, positions, head_dim, generator=g).bfloat16()
    v = torch.randn(slots, kv_heads, positions, head_dim, generator=g).bfloat16()
    return k, v


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(12, 12, 64), (8, 2, 32), (4, 4, 16), (6, 3, 48)],  # the full model, GQA, the tiny model, an odd tail
)
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_matches_plain_attention(heads, kv_heads, head_dim, rows):
    _kernel_or_skip()
    positions, slots_n = 600, 70
    k, v = _cache(slots_n, kv_heads, positions, head_dim)
    g = torch.Generator().manual_seed(rows)
    q = torch.randn(rows, heads, head_dim, generator=g)
    slots = torch.randperm(slots_n, generator=g)[:rows]  # rows gather their slots out of order
    last = torch.randint(0, positions, (rows,), generator=g)  # ragged
    last[0] = positions - 1  # the whole cache
    if rows > 1:
        last[1] = 0  # one position: the softmax of one key is 1
    if rows > 5:  # either side of the kernel's 512-position chunks (and of 256)
        last[2:6] = torch.tensor([255, 256, 511, 512])
    scale = head_dim**-0.5
    out = da.attend(q, k, v, slots, last, scale)
    assert out.shape == (rows, heads, head_dim) and out.dtype == torch.float32
    torch.testing.assert_close(out, da.reference(q, k, v, slots, last, scale), atol=ATOL, rtol=0)
    if rows > 1:
        torch.testing.assert_close(out[1], v[slots[1], :, 0].float().repeat_interleave(heads // kv_heads, 0))


def test_sharp_softmax_and_repeated_slots():
    """Scores in the hundreds (no overflow: each chunk subtracts its max) and two rows on one slot."""
    _kernel_or_skip()
    k, v = _cache(3, 4, 700, 64, seed=1)
    q = 40 * torch.randn(4, 4, 64, generator=torch.Generator().manual_seed(2))
    slots, last = torch.tensor([2, 2, 0, 1]), torch.tensor([699, 300, 17, 512])
    out = da.attend(q, k, v, slots, last, 0.125)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, da.reference(q, k, v, slots, last, 0.125), atol=ATOL, rtol=0)


@pytest.mark.parametrize("cache", ["bf16", "int8"])
def test_a_row_does_not_depend_on_the_batch_or_the_threads(cache):
    _kernel_or_skip()
    k, v, scales = (*_cache(64, 12, 520, 64, seed=3), None) if cache == "bf16" else _int8_cache(64, 12, 520, 64, seed=3)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(64, 12, 64, generator=g)
    slots, last = torch.randperm(64, generator=g), torch.randint(0, 520, (64,), generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batched = da.attend(q, k, v, slots, last, 0.125, scales)
    finally:
        torch.set_num_threads(threads)
    for row in (0, 17, 63):
        alone = da.attend(q[row : row + 1], k, v, slots[row : row + 1], last[row : row + 1], 0.125, scales)
        assert torch.equal(alone[0], batched[row])


@pytest.mark.parametrize("cache", ["bf16", "int8"])
def test_a_query_viewed_in_wider_rows_is_read_in_place_and_scaled_as_torch_would(cache):
    """The decode step's query is a view of its q/k/v rows (row stride 3 x heads x head_dim): read where it
    is, it gives the bits of its contiguous copy; scaled as it is loaded, the bits of ``q * scale``."""
    _kernel_or_skip()
    k, v, scales = (*_cache(8, 12, 700, 64, seed=5), None) if cache == "bf16" else _int8_cache(8, 12, 700, 64, seed=5)
    g = torch.Generator().manual_seed(6)
    qkv = torch.randn(5, 3 * 12 * 64, generator=g)
    q = qkv[:, : 12 * 64].view(5, 12, 64)  # not contiguous
    slots, last = torch.tensor([0, 3, 3, 7, 1]), torch.tensor([699, 40, 511, 512, 0])  # one and two chunks
    scale = 64**-0.5 * 1.1  # not a power of two: the product rounds
    out = da.attend(q, k, v, slots, last, scale, scales)
    assert torch.equal(out, da.attend(q.contiguous(), k, v, slots, last, scale, scales))
    assert torch.equal(out, da.attend(q * scale, k, v, slots, last, 1.0, scales))


@pytest.mark.parametrize("cache", ["bf16", "int8"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(12, 12, 64), (8, 2, 32), (6, 3, 48)])
def test_a_prompts_rows_share_their_keys_and_keep_their_bits(cache, heads, kv_heads, head_dim):
    """A prefill's rows: one slot's tokens at consecutive positions attend in groups that widen each block of
    keys and values once. Each row gets the bits it gets alone, and the attention a float64 oracle gives;
    around them, rows of other slots, a prompt that runs past the 512-position chunk (those rows go one by
    one) and a prompt of one token."""
    _kernel_or_skip()
    if cache == "bf16":
        k, v, scales = (*_cache(4, kv_heads, 600, head_dim, seed=7), None)
    else:
        k, v, scales = _int8_cache(4, kv_heads, 600, head_dim, seed=7)
    runs = [(2, 0, 37), (0, 3, 1), (3, 490, 40), (1, 100, 13)]  # (slot, first position, tokens)
    slots = torch.tensor([slot for slot, _, n in runs for _ in range(n)])
    last = torch.tensor([p for _, first, n in runs for p in range(first, first + n)])
    q = torch.randn(len(last), heads, head_dim, generator=torch.Generator().manual_seed(8))
    out = da.attend(q, k, v, slots, last, head_dim**-0.5, scales)
    for row in range(len(last)):
        alone = da.attend(q[row : row + 1], k, v, slots[row : row + 1], last[row : row + 1], head_dim**-0.5, scales)
        assert torch.equal(out[row], alone[0]), row
    atol = ATOL if cache == "bf16" else ATOL_INT8
    torch.testing.assert_close(out, da.reference(q, k, v, slots, last, head_dim**-0.5, scales), atol=atol, rtol=0)


def test_bad_inputs_are_refused():
    _kernel_or_skip()
    k, v = _cache(2, 2, 10, 32)
    q = torch.randn(1, 2, 32)
    with pytest.raises(RuntimeError, match="slot 2 out of range"):
        da.attend(q, k, v, torch.tensor([2]), torch.tensor([0]), 1.0)
    with pytest.raises(RuntimeError, match="last position 10 out of range"):
        da.attend(q, k, v, torch.tensor([0]), torch.tensor([10]), 1.0)
    with pytest.raises(ValueError, match="one slot and one last position per row"):
        da.attend(q, k, v, torch.tensor([0, 1]), torch.tensor([0, 1]), 1.0)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        da.attend(torch.randn(1, 3, 32), k, v, torch.tensor([0]), torch.tensor([0]), 1.0)


def test_only_a_bf16_cpu_cache_uses_it(monkeypatch):
    assert not da.applies(torch.empty(1, 1, 1, 64))  # fp32: torch's SDPA, bit-exact with the reference
    assert not da.applies(torch.empty(1, 1, 1, 24, dtype=torch.bfloat16))  # head_dim not a multiple of 16
    monkeypatch.setenv(da.MODE_ENV, "torch")
    assert not da.applies(torch.empty(1, 1, 1, 64, dtype=torch.bfloat16))


def _decode_bf16(gpt: GPT) -> torch.Tensor:
    """Two rows on slots 2 and 0 of a bf16 cache, after prompts of 9 and 5 positions: one decode step."""
    hidden = gpt.cfg.hidden_size
    g = torch.Generator().manual_seed(7)
    cache = gpt.new_cache(3, 16, dtype=torch.bfloat16)
    with torch.inference_mode():
        for slot, n in ((2, 9), (0, 5)):
            gpt(torch.randn(1, n, hidden, generator=g), torch.arange(n)[None], cache, torch.tensor([slot]), 0, None)
        return gpt.decode(torch.randn(2, hidden, generator=g), cache, [2, 0], [9, 5])


def test_no_compiler_falls_back_to_torch_with_one_warning(monkeypatch):
    """A slim container without a compiler: the step runs on torch's SDPA, after one warning."""
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96)).eval()
    with_kernel = _decode_bf16(gpt)  # the kernel where it runs here, else torch's SDPA already
    monkeypatch.setattr(cpp_build, "find_compiler", lambda: None)
    # A fresh once-per-process loader, as in a new process (the loaded op is never loaded twice: a
    # second load of its library would register its namespace again).
    monkeypatch.setattr(da, "_library", da._library.fresh())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fallback = _decode_bf16(gpt)
        _decode_bf16(gpt)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    if da.cpu_supported():
        assert len(messages) == 1 and "no C++ compiler" in messages[0]
    # torch's path rounds the query to bf16 and runs in bf16 SDPA: close to the kernel, not equal.
    assert torch.isfinite(fallback).all()
    torch.testing.assert_close(fallback, with_kernel, atol=5e-2, rtol=5e-2)


# ------------------------------------------------------------------ the int8 cache (one fp32 scale per vector)


def _int8_cache(slots: int, kv_heads: int, positions: int, head_dim: int, seed: int = 0):
    """An int8 cache quantized from random values (``kernels.kv_int8``): int8 keys, values and their scales."""
    k, v = _cache(slots, kv_heads, positions, head_dim, seed)
    (qk, sk), (qv, sv) = kv_int8.quantize(k.float()), kv_int8.quantize(v.float())
    return qk, qv, (sk, sv)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(12, 12, 64), (8, 2, 32), (4, 4, 16), (6, 3, 48)])
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_int8_matches_plain_attention_in_float64(heads, kv_heads, head_dim, rows):
    """The int8 op against float64 attention over the dequantized cache (the scales folded into the dots
    and the weights are the same numbers): what is left is the kernel's fp32 rounding, as for bf16."""
    _kernel_or_skip()
    positions, slots_n = 600, 70
    k, v, scales = _int8_cache(slots_n, kv_heads, positions, head_dim)
    g = torch.Generator().manual_seed(rows)
    q = torch.randn(rows, heads, head_dim, generator=g)
    slots = torch.randperm(slots_n, generator=g)[:rows]
    last = torch.randint(0, positions, (rows,), generator=g)
    last[0] = positions - 1
    if rows > 1:
        last[1] = 0
    if rows > 5:  # either side of the 512-position chunks, and a partial block of 16 with scales past it
        last[2:6] = torch.tensor([255, 256, 511, 512])
    scale = head_dim**-0.5
    out = da.attend(q, k, v, slots, last, scale, scales)
    assert out.shape == (rows, heads, head_dim) and out.dtype == torch.float32
    torch.testing.assert_close(out, da.reference(q, k, v, slots, last, scale, scales), atol=ATOL_INT8, rtol=0)
    if rows > 1:  # one key: the output is its value, dequantized
        want = kv_int8.dequantize(v[slots[1], :, 0], scales[1][slots[1], :, 0])
        torch.testing.assert_close(out[1], want.repeat_interleave(heads // kv_heads, 0))


def test_int8_sharp_softmax_zero_vectors_and_repeated_slots():
    """Scores in the hundreds, all-zero keys and values (scale 0), two rows on one slot, a query head of
    zeros (its int16 scale 0: every score 0, the values' mean)."""
    _kernel_or_skip()
    k, v, (sk, sv) = _int8_cache(3, 4, 700, 64, seed=1)
    k[2, :, 100:140], sk[2, :, 100:140] = 0, 0
    v[2, :, 120:160], sv[2, :, 120:160] = 0, 0
    q = 40 * torch.randn(4, 4, 64, generator=torch.Generator().manual_seed(2))
    q[3, 1] = 0
    slots, last = torch.tensor([2, 2, 0, 1]), torch.tensor([699, 300, 17, 512])
    out = da.attend(q, k, v, slots, last, 0.125, (sk, sv))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, da.reference(q, k, v, slots, last, 0.125, (sk, sv)), atol=ATOL_INT8, rtol=0)


def test_int8_bad_inputs_are_refused():
    _kernel_or_skip()
    k, v, (sk, sv) = _int8_cache(2, 2, 10, 32)
    q = torch.randn(1, 2, 32)
    one, zero = torch.tensor([1]), torch.tensor([0])
    with pytest.raises(ValueError, match="needs its scales"):
        da.attend(q, k, v, one, zero, 1.0)
    with pytest.raises(ValueError, match="needs its scales"):
        da.attend(q, k.bfloat16(), v.bfloat16(), one, zero, 1.0, (sk, sv))
    with pytest.raises(RuntimeError, match="scales must be \\[slots, kv_heads, positions\\]"):
        da.attend(q, k, v, one, zero, 1.0, (sk[:, :, :5], sv))
    with pytest.raises(RuntimeError, match="scales must be float32"):
        da.attend(q, k, v, one, zero, 1.0, (sk.double(), sv))
    with pytest.raises(RuntimeError, match="last position 10 out of range"):
        da.attend(q, k, v, zero, torch.tensor([10]), 1.0, (sk, sv))


def test_an_int8_cpu_cache_uses_it_too(monkeypatch):
    if da.cpu_supported():
        assert da.applies(torch.empty(1, 1, 1, 64, dtype=torch.int8)) == da.applies(
            torch.empty(1, 1, 1, 64, dtype=torch.bfloat16)
        )
    assert not da.applies(torch.empty(1, 1, 1, 64, dtype=torch.uint8))
    monkeypatch.setenv(da.MODE_ENV, "torch")
    assert not da.applies(torch.empty(1, 1, 1, 64, dtype=torch.int8))


def _decode(gpt: GPT, dtype: torch.dtype) -> torch.Tensor:
    """``_decode_bf16`` in a cache of ``dtype``."""
    hidden = gpt.cfg.hidden_size
    g = torch.Generator().manual_seed(7)
    cache = gpt.new_cache(3, 16, dtype=dtype)
    with torch.inference_mode():
        for slot, n in ((2, 9), (0, 5)):
            gpt(torch.randn(1, n, hidden, generator=g), torch.arange(n)[None], cache, torch.tensor([slot]), 0, None)
        return gpt.decode(torch.randn(2, hidden, generator=g), cache, [2, 0], [9, 5])


def test_int8_torch_fallback_is_the_same_math(monkeypatch):
    """Where the op does not run, ``_attend_rows`` dequantizes each row to fp32 and runs torch's SDPA in fp32:
    the op's result up to fp32 rounding (unlike bf16's fallback, which rounds the query to bf16)."""
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96)).eval()
    with_kernel = _decode(gpt, torch.int8)
    monkeypatch.setenv(da.MODE_ENV, "torch")
    fallback = _decode(gpt, torch.int8)
    torch.testing.assert_close(fallback, with_kernel, atol=1e-5, rtol=1e-5)
    fp32 = _decode(gpt, torch.float32)
    torch.testing.assert_close(fallback, fp32, atol=5e-2, rtol=5e-2)  # int8 keys: close to fp32, not equal


_NO_VNNI_CHILD = r"""
import sys, torch
from chattts_serve.kernels import cpp_build, decode_attention as da
flags = [f for f in da._flags() if f != "-mavx512vnni"] + ["-mno-avx512vnni"]
why = cpp_build.build("chattts_decode_attention_no_vnni", da._SOURCE, flags)
assert why is None, why
args = torch.load(sys.argv[1])
torch.save(torch.ops.chattts_decode_attention.int8(*args), sys.argv[2])
"""


@pytest.mark.slow
def test_int8_without_vnni_gives_the_same_bits(tmp_path):
    """An AVX-512 CPU without VNNI builds the int8 op with vpmaddwd + vpaddd instead of vpdpwssd: the same
    integers, so the same bits. Built here without the flag in a child process (one op library a process)."""
    _kernel_or_skip()
    k, v, (sk, sv) = _int8_cache(5, 4, 600, 48, seed=11)
    q = 30 * torch.randn(6, 8, 48, generator=torch.Generator().manual_seed(12))
    slots, last = torch.tensor([4, 0, 0, 2, 2, 2]), torch.tensor([599, 3, 4, 511, 512, 100])
    args = (q, k, v, sk, sv, slots, last, 48**-0.5)
    torch.save(args, tmp_path / "args.pt")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    run = subprocess.run(
        [sys.executable, "-c", _NO_VNNI_CHILD, str(tmp_path / "args.pt"), str(tmp_path / "out.pt")],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert torch.equal(torch.load(tmp_path / "out.pt"), da.attend(q, k, v, slots, last, 48**-0.5, (sk, sv)))
