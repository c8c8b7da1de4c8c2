"""Precision modes: int8 quantisation, the module swaps and their kernels, against plain fp32 math."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from chattts_serve.kernels.linear import swap_linears_
from chattts_serve.kernels.quant import (
    DynamicInt8Linear,
    Int4GemvLinear,
    Int8Linear,
    StaticInt8Linear,
    apply_precision_,
    check_supported,
    parse_precision,
    quantize_weight,
    record_absmax,
)

CPU = torch.device("cpu")


def _linear(n_in=96, n_out=64, seed=0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(n_in, n_out, bias=False)
    nn.init.normal_(lin.weight, std=0.05)
    return lin


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_parse_precision_names_and_errors():
    assert parse_precision("fp32").name == "fp32"
    assert parse_precision("int8-static").int8 == "static"
    assert parse_precision("int4").int4 and parse_precision("int4").trunk_dtype == torch.float32
    for bad in ("int3", "bfloat16"):  # names only: EngineConfig accepts nothing else either
        with pytest.raises(ValueError, match="precision must be one of"):
            parse_precision(bad)


def test_check_supported_refuses_what_the_device_cannot_run():
    with pytest.raises(ValueError, match="fp16 needs a CUDA device"):
        check_supported(parse_precision("fp16"), CPU)
    for name in ("int8-dynamic", "int8-static"):
        with pytest.raises(ValueError, match="fbgemm CPU kernels"):
            check_supported(parse_precision(name), torch.device("cuda"))
    with pytest.raises(ValueError, match="runs a CPU kernel"):
        check_supported(parse_precision("int4"), torch.device("cuda"))
    for name in ("fp32", "bf16", "int8", "int8-dynamic", "int8-static"):
        check_supported(parse_precision(name), CPU)


def test_quantize_weight_is_per_channel_and_bounded():
    w = torch.randn(32, 40)
    w[3] *= 100  # one loud channel must not cost the others their resolution
    q, scale = quantize_weight(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert torch.allclose(scale, w.abs().amax(1) / 127)
    err = (q.float() * scale[:, None] - w).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-6).all())


@pytest.mark.parametrize("rows", [1, 5])
def test_int8_weight_only_matches_fp32(rows):
    lin = _linear()
    x = torch.randn(rows, 96)
    y = Int8Linear(lin, torch.bfloat16)(x)
    assert y.dtype == torch.float32 and y.shape == (rows, 64)
    assert _rel(y, lin(x)) < 0.02


def test_int8_dequant_fallback_matches_fused():
    lin = _linear()
    x = torch.randn(4, 96)
    fused = Int8Linear(lin, torch.bfloat16)
    plain = Int8Linear(lin, torch.bfloat16)
    plain._fused = False  # the path taken where torch has no fused int8 kernel (e.g. some CUDA builds)
    assert _rel(plain(x), fused(x)) < 0.01


def test_dynamic_and_static_int8_match_fp32():
    lin = _linear()
    x = torch.randn(8, 3, 96)
    want = lin(x)
    assert _rel(DynamicInt8Linear(lin)(x), want) < 0.05
    assert _rel(StaticInt8Linear(lin, float(x.abs().max()))(x), want) < 0.05


def test_static_int8_is_batch_invariant_and_dynamic_is_not():
    lin = _linear(768, 256)
    x = torch.randn(16, 768)
    x[7] *= 20  # a loud row changes a per-call activation scale
    static = StaticInt8Linear(lin, float(x.abs().max()))
    full = static(x)
    for n in (1, 3, 8):
        assert torch.equal(static(x[:n]), full[:n])
    dyn = DynamicInt8Linear(lin)
    assert not torch.equal(dyn(x[:1]), dyn(x)[:1])


def test_int4_gemv_linear_matches_fp32_and_is_batch_invariant_at_every_width():
    # Wider than the kernel's 8 rows a pass (prefill, many slots): the same per-row arithmetic, so a row's
    # output is bit-identical alone, among 8 and among 40.
    lin = _linear(768, 96)
    m = Int4GemvLinear(lin)
    assert m.packed.block == 128 and m.packed.bf16_scales
    x = torch.randn(40, 768)
    x[7] *= 20  # a loud neighbour must not move the other rows (per-row activation scales)
    full = m(x)
    for n in (1, 3, 8, 9, 17):
        assert torch.equal(m(x[:n]), full[:n])
    assert torch.equal(m(x[9:10]), full[9:10])
    assert _rel(m(x.view(4, 10, 768)), lin(x).view(4, 10, 96)) < 0.15  # 4-bit weights in blocks of 128: ~0.12
    assert m(x.bfloat16()).dtype == torch.bfloat16


def test_int4_gemv_linear_narrow_inputs_take_a_smaller_block():
    assert Int4GemvLinear(_linear(64, 32)).packed.block == 64
    with pytest.raises(ValueError, match="multiples of 32"):
        Int4GemvLinear(_linear(48, 32))


def test_static_int8_saturates_beyond_the_calibrated_range():
    lin = _linear()
    x = torch.randn(2, 96)
    small = StaticInt8Linear(lin, 0.1)  # calibrated far too small: inputs clip
    assert _rel(small(x), lin(x)) > 0.3


def test_record_absmax_and_swap():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 2)))
    x = torch.tensor([[1.0, -3.0, 2.0, 0.5]])
    seen = record_absmax(model, lambda: model(x))
    assert seen["0"] == 3.0 and set(seen) == {"0", "2.0"}
    assert not model[0]._forward_hooks  # hooks removed
    n = swap_linears_(model, lambda name, lin: StaticInt8Linear(lin, seen[name]))
    assert n == 2 and isinstance(model[2][0], StaticInt8Linear)


def test_apply_precision_to_a_trunk(tiny_ckpt):
    from chattts_serve.models.chattts.checkpoint import load

    m = load(tiny_ckpt)
    apply_precision_(m.gpt, parse_precision("int8"), CPU)
    assert not any(isinstance(x, nn.Linear) for x in m.gpt.modules())
    assert {p.dtype for p in m.gpt.parameters()} == {torch.bfloat16}  # the norms
    m = load(tiny_ckpt)
    apply_precision_(m.gpt, parse_precision("int4"), CPU)
    assert not any(isinstance(x, nn.Linear) for x in m.gpt.modules())
    assert any(isinstance(x, Int4GemvLinear) for x in m.gpt.modules())
    assert {p.dtype for p in m.gpt.parameters()} == {torch.float32}
    m = load(tiny_ckpt)
    with pytest.raises(ValueError, match="needs calibration"):
        apply_precision_(m.gpt, parse_precision("int8-static"), CPU)
    with pytest.raises(ValueError, match="calibration saw no input"):
        apply_precision_(m.gpt, parse_precision("int8-static"), CPU, absmax={})
