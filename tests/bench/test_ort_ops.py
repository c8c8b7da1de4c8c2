"""ORT's per-op profile read by ``profile --ops`` (bench/ort_ops.py): kernels assigned to their run,
op types to the floor they answer to. Pure functions over hand-made profiles: no ONNX Runtime needed."""

from __future__ import annotations

import pytest

from chattts_serve.bench.ort_ops import op_breakdown, op_class, op_seconds

pytestmark = pytest.mark.timeout(60)


def test_op_seconds_assigns_nodes_to_their_run():
    def run(ts, dur):
        return {"cat": "Session", "name": "model_run", "ts": ts, "dur": dur}

    def node(ts, dur, op):
        return {"cat": "Node", "name": f"n_{op}_kernel_time", "ts": ts, "dur": dur, "args": {"op_name": op}}

    events = [
        node(5, 9, "MatMul"),  # before any run (session set-up): no run's
        run(10, 100),
        node(20, 30, "MatMul"),
        node(60, 40, "GroupQueryAttention"),
        {"cat": "Node", "name": "n_fence_before", "ts": 61, "dur": 1000, "args": {"op_name": "MatMul"}},
        run(200, 50),
        node(210, 10, "MatMul"),
        node(220, 20, "MatMul"),
    ]
    seconds = op_seconds(events, ["prefill", "decode"])
    assert seconds["prefill"] == pytest.approx({"GroupQueryAttention": 40e-6, "MatMul": 30e-6})
    assert seconds["decode"] == pytest.approx({"MatMul": 30e-6})
    assert seconds["runs"] == {"decode": 1, "prefill": 1}
    assert seconds["run_s"] == pytest.approx({"decode": 50e-6, "prefill": 100e-6})
    with pytest.raises(ValueError, match="2 runs, expected 1"):
        op_seconds(events, ["decode"])


def test_op_classes_name_each_ort_op_by_its_floor():
    assert [op_class(op) for op in ("DynamicQuantizeMatMul", "MatMulNBits", "MatMul", "Gemm")] == ["matmul"] * 4
    assert op_class("GroupQueryAttention") == op_class("MultiHeadAttention") == "attention"
    assert op_class("SkipSimplifiedLayerNormalization") == op_class("Where") == "other"
    seconds = {
        "decode": {"MatMulNBits": 0.2, "GroupQueryAttention": 0.1, "Where": 0.02},
        "prefill": {"MatMulNBits": 0.5},
        "runs": {"decode": 10, "prefill": 1},
        "run_s": {"decode": 0.4, "prefill": 0.6},
    }
    r = op_breakdown(seconds, matmul_floor_ms=10.0, attention_floor_ms=2.0)
    assert r["decode_op_ms_per_step"] == {"MatMulNBits": 20.0, "GroupQueryAttention": 10.0, "Where": 2.0}
    assert r["decode_classes"]["matmul"] == {"ms": 20.0, "floor_ms": 10.0, "floor_ratio": 0.5}
    assert r["decode_classes"]["attention"] == {"ms": 10.0, "floor_ms": 2.0, "floor_ratio": 0.2}
    assert r["decode_classes"]["other"] == {"ms": 2.0, "floor_ms": None, "floor_ratio": None}
    assert r["decode_run_ms_per_step"] == 40.0 and r["decode_kernel_ms_per_step"] == 32.0
    assert r["prefill_runs"] == 1 and r["prefill_s"] == {"MatMulNBits": 0.5}
