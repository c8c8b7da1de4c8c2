"""kernels/int4_cpu.py: torch's CPU 4-bit weight kernel against float64 on the same codes, the
quantisation against the float weights, and its batch invariance."""

from __future__ import annotations

import pytest
import torch

from chattts_serve.kernels import int4_cpu

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not int4_cpu.available(), reason="this torch has no CPU int4 kernel"),
]


def _weight(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(out, inp, generator=torch.Generator().manual_seed(seed)) * inp**-0.5


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 4, 33])
@pytest.mark.parametrize("out", [48, 40])  # 40: not a multiple of the kernel's 16-row tile
def test_fp32_matches_float64_on_the_same_codes(group, rows, out):
    w = _weight(out, 256)
    q, _ = int4_cpu.quantize(w, group)
    packed = int4_cpu.pack_int4(w, group, torch.float32)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    y = int4_cpu.int4_linear(x, packed)
    assert y.shape == (rows, out) and y.dtype == torch.float32
    ref = x.double() @ int4_cpu.dequantize(packed, q).t()
    # fp32 accumulation of 256 products of size ~1/16 each: well under 1e-5 absolute
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)


def test_quantisation_error_is_within_half_a_step():
    w = _weight(64, 256, seed=1)
    q, scale = int4_cpu.quantize(w, 32)
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    packed = int4_cpu.pack_int4(w, 32)
    err = (int4_cpu.dequantize(packed, q) - w.double()).abs().reshape(64, 8, 32)
    assert bool((err <= scale.double()[..., None] / 2 + 1e-7).all())


def test_bf16_activations_stay_close_to_the_fp32_path():
    w = _weight(64, 256, seed=2)
    x = torch.randn(5, 256)
    y32 = int4_cpu.int4_linear(x, int4_cpu.pack_int4(w, 32, torch.float32))
    y16 = int4_cpu.int4_linear(x, int4_cpu.pack_int4(w, 32, torch.bfloat16))
    assert y16.dtype == torch.float32  # returned in the input's dtype
    torch.testing.assert_close(y16, y32, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_does_not_depend_on_the_batch(dtype):
    w = _weight(96, 512, seed=3)
    packed = int4_cpu.pack_int4(w, 32, dtype)
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(4))
    full = int4_cpu.int4_linear(x, packed)
    for rows in (1, 3, 4, 17, 32):
        torch.testing.assert_close(int4_cpu.int4_linear(x[:rows], packed), full[:rows], atol=0, rtol=0)


def test_a_group_that_does_not_divide_the_inputs_is_refused():
    with pytest.raises(ValueError, match="multiple of the group size"):
        int4_cpu.pack_int4(_weight(16, 96), 64)
