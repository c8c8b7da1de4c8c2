"""kernels/kv_int8.py: the int8 KV cache's number format, one symmetric absmax scale per vector."""

from __future__ import annotations

import torch

from chattts_serve.kernels import kv_int8


def test_round_trip_error_is_half_a_step_per_number():
    x = torch.randn(5, 3, 40, 64, generator=torch.Generator().manual_seed(0)) * 3
    q, scale = kv_int8.quantize(x)
    assert q.dtype == torch.int8 and scale.dtype == kv_int8.SCALE_DTYPE and scale.shape == x.shape[:-1]
    assert int(q.abs().max()) == kv_int8.QMAX  # each vector's largest number maps to +-127 exactly
    torch.testing.assert_close(scale, x.abs().amax(-1) / 127)
    err = (kv_int8.dequantize(q, scale) - x).abs()
    assert (err <= scale[..., None] / 2 * (1 + 1e-5)).all()


def test_a_vector_depends_on_its_own_values_only():
    """Batch invariance: quantizing a slice gives the slice of the whole's bytes (chunked prefill, one row)."""
    x = torch.randn(8, 2, 30, 32, generator=torch.Generator().manual_seed(1))
    q, scale = kv_int8.quantize(x)
    q1, s1 = kv_int8.quantize(x[3:4, :, 7:19])
    assert torch.equal(q1, q[3:4, :, 7:19]) and torch.equal(s1, scale[3:4, :, 7:19])


def test_zero_vectors_and_bf16_inputs():
    x = torch.zeros(2, 16)
    x[1] = torch.linspace(-1, 1, 16)
    q, scale = kv_int8.quantize(x.bfloat16())
    assert scale[0] == 0 and (q[0] == 0).all() and torch.isfinite(kv_int8.dequantize(q, scale)).all()
    assert kv_int8.dequantize(q, scale, torch.bfloat16).dtype == torch.bfloat16
