"""bench kernels (bench/kernels.py, bench/trunk_backends.py): the trunk's op shapes, a quick run of
torch's backends on one full-size layer, each backend's chain against fp32, and the tables."""

from __future__ import annotations

import argparse

import pytest
import torch

from chattts_serve.bench import kernels, trunk_backends
from chattts_serve.bench.trunk_backends import OPS, TrunkShape

pytestmark = pytest.mark.timeout(300)


def test_trunk_shape_of_the_full_model():
    s = kernels.trunk_shape(None, None)
    assert (s.hidden, s.intermediate, s.layers, s.qkv_out, s.heads_out) == (768, 3072, 20, 2304, 2504)
    per_layer = 2304 * 768 + 768 * 768 + 6144 * 768 + 768 * 3072
    assert s.params() == 20 * per_layer + 2504 * 768
    assert sum(s.params(o) for o in OPS) == s.params()


def test_each_torch_backend_runs_the_fp32_weights():
    shape = TrunkShape(hidden=128, intermediate=256, layers=2, qkv_out=384, heads_out=40)
    weights = trunk_backends.random_weights(shape, seed=1)
    x, down_x = torch.randn(4, 128), torch.randn(4, 256)
    builders = trunk_backends.torch_backends(shape, weights, None)
    assert {"torch-fp32", "onednn-fp32", "int8w-bf16"} <= set(builders)
    fp32 = builders.pop("torch-fp32")()
    assert fp32.step(x).shape == (4, 40)
    for name, make in builders.items():
        b = make()
        assert b.weight_bytes > 0
        y = b.step(x)
        assert y.shape == (4, 40) and y.dtype == torch.float32, name
        if name == "fbgemm-int8-static":
            continue  # a fixed activation range, not calibrated here: it saturates (its speed is what is timed)
        for op in OPS:
            xi = down_x if op == "down" else x
            ref = fp32.op(op, 0, xi)
            # 4-bit weights: ~10 % relative noise per matmul; it catches a transposed or unscaled weight
            rel = float((b.op(op, 0, xi) - ref).norm() / ref.norm())
            assert rel < 0.2, f"{name} {op}: {rel}"


def test_a_quick_run_gives_every_table_cell():
    args = argparse.Namespace(
        model=None,
        rows="1,4",
        rounds=1,
        threads=1,
        backends="torch-fp32,int8w-bf16",
        layers=1,
        profile_runs=1,
        work_dir=None,
        bandwidth_mb=64,
        seed=0,
    )
    result = kernels.measure(args)
    assert result["read_gbs"] > 0 and result["failed"] == {}
    for name in ("torch-fp32", "int8w-bf16"):
        e = result["backends"][name]
        assert e["floor_ms"] > 0
        for r in (1, 4):
            row = e[f"rows_{r}"]
            assert row["step_ms"] > 0 and row["of_floor"] > 0 and set(row["ops_ms"]) == set(OPS)
    # against the float64 chain: fp32 to rounding, int8 weights with bf16 activations well above it
    fp32_err = result["backends"]["torch-fp32"]["rows_4"]["rel_err"]
    assert fp32_err < 1e-5 < 1e-3 < result["backends"]["int8w-bf16"]["rows_4"]["rel_err"] < 0.2
    table = kernels.markdown(result)
    assert "| int8w-bf16 |" in table and "per op, 4 row(s)" in table


def test_an_unknown_backend_is_named():
    args = argparse.Namespace(
        model=None,
        rows="1",
        rounds=1,
        threads=1,
        backends="torch-fp32,nope",
        layers=1,
        profile_runs=1,
        work_dir=None,
        bandwidth_mb=8,
        seed=0,
    )
    with pytest.raises(ValueError, match="nope"):
        kernels.measure(args)
