"""kernels/int4_gemv.py: the C++ 4-bit GEMV against float64 on the same codes (activations quantised as
the kernel does, and plain), odd shapes, 1-8 rows and more, its batch and thread invariance, and the
fallback where it cannot be built."""

from __future__ import annotations

import warnings

import pytest
import torch

from chattts_serve.kernels import cpp_build
from chattts_serve.kernels import int4_gemv as ig

pytestmark = pytest.mark.timeout(300)


def _kernel_or_skip() -> None:
    if not ig.available():
        pytest.skip("the int4 GEMV does not run here (no AVX-512 VNNI or no compiler)")


def _weight(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(out, inp, generator=torch.Generator().manual_seed(seed)) * inp**-0.5


def _x(rows: int, inp: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, inp, generator=torch.Generator().manual_seed(seed))


def _on_two_threads(run):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        return run()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("block", ig.BLOCKS)
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("out", "inp"), [(64, 256), (40, 384), (2504, 768), (17, 128)])  # odd tails
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_matches_float64_on_the_same_codes(block, scale_dtype, out, inp, rows):
    _kernel_or_skip()
    w = _weight(out, inp)
    q, scale = ig.quantize(w, block, scale_dtype)
    packed = ig.pack(w, block, scale_dtype)
    assert packed.dense is None
    x = _x(rows, inp, seed=rows)
    y = ig.linear(x, packed)
    assert y.shape == (rows, out) and y.dtype == torch.float32
    # Exact int block sums; what is left is fp32 rounding of scale products and of the block sums.
    ref = ig.reference(x, q, scale, block)
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
    # Against the unquantised activations on the same weights: int8 per block costs ~0.5 % relative.
    plain = x.double() @ ig.dequantize(q, scale).t()
    assert float((y.double() - plain).norm() / plain.norm()) < 0.01


@pytest.mark.parametrize("rows", [9, 17])
def test_more_than_eight_rows_run_in_passes(rows):
    _kernel_or_skip()
    w = _weight(96, 256, seed=2)
    q, scale = ig.quantize(w, 32)
    x = _x(rows, 256, seed=3)
    torch.testing.assert_close(
        ig.linear(x, ig.pack(w, 32)).double(), ig.reference(x, q, scale, 32), atol=1e-5, rtol=1e-5
    )


def test_quantisation_error_is_within_half_a_step():
    w = _weight(64, 256, seed=1)
    for dtype in (torch.float32, torch.bfloat16):
        q, scale = ig.quantize(w, 32, dtype)
        assert int(q.min()) >= -8 and int(q.max()) <= 7
        err = (ig.dequantize(q, scale) - w.double()).abs().reshape(64, 8, 32)
        step = scale.double().abs()[..., None]
        # half a step, but for a value of the peak's magnitude and the other sign (clamped to 7: one
        # step at most); bf16: the scale's rounding (2^-9 relative) times the code, up to 8
        unclamped = w.reshape(64, 8, 32).abs() < 7.5 * step
        slack = 1e-7 if dtype == torch.float32 else float(8 * 2**-9 * step.max())
        assert bool((err <= step * 0.5 + slack)[unclamped].all())
        assert bool((err <= step + slack).all())
        peaks = q.reshape(64, 8, 32).eq(-8).any(-1)  # every block uses the code -8 (its peak)
        assert bool(peaks.all())
    q, scale = ig.quantize(torch.zeros(16, 128), 128)  # an all-zero block: scale 0, codes 0
    assert not q.any() and not scale.any()


def test_zero_rows_and_zero_blocks():
    _kernel_or_skip()
    w = _weight(32, 256, seed=4)
    w[:, :128] = 0  # a block of zero weights
    packed = ig.pack(w, 128)
    x = _x(2, 256, seed=5)
    x[1] = 0  # a row of zeros: every x block's scale is 0
    x[0, 128:] = 0
    y = ig.linear(x, packed)
    assert torch.equal(y[1], torch.zeros(32)) and torch.equal(y[0], torch.zeros(32))
    assert ig.linear(torch.empty(0, 256), packed).shape == (0, 32)


def test_a_row_does_not_depend_on_the_batch_or_the_threads():
    _kernel_or_skip()
    w = _weight(2304, 768, seed=6)  # 72 tiles: both threads get some
    packed = ig.pack(w, 128)
    x = _x(19, 768, seed=7)  # three passes of at most 8 rows, in each thread's share of the tiles
    batched = _on_two_threads(lambda: ig.linear(x, packed))
    for row in range(19):
        assert torch.equal(ig.linear(x[row : row + 1], packed)[0], batched[row])
    for n in range(2, 8):  # every row count's code path
        assert torch.equal(ig.linear(x[19 - n :], packed), batched[19 - n :])


@pytest.mark.parametrize("rows", [63, 64, 256, 257])
def test_wide_calls_give_each_row_its_one_row_result(rows):
    # Around the C++ thresholds: x quantised on every thread from 64 rows, the weights in runs of tiles
    # up to 256 rows and in one run above; on 2 threads, every row as it is alone.
    _kernel_or_skip()
    w = _weight(2304, 256, seed=11)  # 72 tiles: several runs in each thread's share
    packed = ig.pack(w, 64, torch.bfloat16)
    x = _x(rows, 256, seed=rows)
    batched = _on_two_threads(lambda: ig.linear(x, packed))
    alone = torch.cat([ig.linear(x[r : r + 1], packed) for r in range(rows)])
    assert torch.equal(batched, alone)


def test_prefetch_distance_does_not_change_the_result(monkeypatch):
    _kernel_or_skip()
    w = _weight(64, 512, seed=8)
    packed = ig.pack(w, 32, torch.bfloat16)
    x = _x(4, 512, seed=9)
    plain = ig.linear(x, packed)
    monkeypatch.setenv(ig.PREFETCH_ENV, "0")
    assert torch.equal(ig.linear(x, packed), plain)


def test_leading_dims_and_dtypes():
    _kernel_or_skip()
    w = _weight(48, 128, seed=10)
    packed = ig.pack(w, 64)
    x = _x(6, 128, seed=11)
    y = ig.linear(x.reshape(2, 3, 128).bfloat16(), packed)
    assert y.shape == (2, 3, 48) and y.dtype == torch.float32
    assert torch.equal(y.reshape(6, 48), ig.linear(x.bfloat16().float(), packed))


def test_bad_inputs_are_refused():
    _kernel_or_skip()
    packed = ig.pack(_weight(32, 128), 32)
    op = torch.ops.chattts_int4_gemv.gemv
    with pytest.raises(RuntimeError, match="multiple of the block"):
        op(torch.randn(1, 96), packed.blob, 32, 64, False, 0)
    with pytest.raises(RuntimeError, match="expected"):
        op(torch.randn(1, 128), packed.blob, 64, 32, False, 0)
    with pytest.raises(ValueError, match="multiple of the block size"):
        ig.quantize(torch.randn(4, 100), 32)
    with pytest.raises(ValueError, match="block must be one of"):
        ig.quantize(torch.randn(4, 96), 48)


def test_no_compiler_falls_back_to_a_dense_matmul_with_one_warning(monkeypatch):
    monkeypatch.setattr(cpp_build, "find_compiler", lambda: None)
    # A fresh once-per-process loader, as in a new process (the op library is never loaded twice).
    monkeypatch.setattr(ig, "_library", ig._library.fresh())
    w = _weight(40, 256, seed=12)
    x = _x(3, 256, seed=13)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        packed = ig.pack(w, 128)
        ig.pack(w, 32)
    assert len([c for c in caught if issubclass(c.category, RuntimeWarning)]) == 1
    assert packed.dense is not None and packed.nbytes == 40 * 256 * 4
    q, scale = ig.quantize(w, 128)
    torch.testing.assert_close(
        ig.linear(x, packed).double(), x.double() @ ig.dequantize(q, scale).t(), atol=1e-5, rtol=1e-5
    )
