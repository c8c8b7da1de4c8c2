"""ONNX Runtime's per-op profile of the trunk step (``profile --ops``): kernel seconds per op type,
per run kind (``op_seconds``), and per decode step against the memory floor each op class answers to
(``op_breakdown``). The trunk records (``OnnxTrunk.start_op_profile`` / ``end_op_profile``); this
module reads what it recorded.
"""

from __future__ import annotations

from collections import defaultdict


def op_seconds(events: list[dict], kinds: list[str]) -> dict[str, dict[str, float]]:
    """Kernel seconds per op type from an ORT profile (its JSON event list), summed over the runs of
    each kind: ``kinds[i]`` names the i-th ``model_run``; a node belongs to the run whose span holds
    its start. Also ``"runs"`` (runs of each kind) and ``"run_s"`` (their whole spans: kernels plus
    ORT's own work between them). ValueError when the profile holds another number of runs."""
    runs = sorted(
        (e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"), key=lambda e: e["ts"]
    )
    if len(runs) != len(kinds):
        raise ValueError(f"the ORT profile holds {len(runs)} runs, expected {len(kinds)}")
    nodes = sorted(
        (e for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")),
        key=lambda e: e["ts"],
    )
    out: dict[str, dict[str, float]] = {"decode": defaultdict(float), "prefill": defaultdict(float)}
    run_s = {"decode": 0.0, "prefill": 0.0}
    i = 0
    for run, kind in zip(runs, kinds, strict=True):
        run_s[kind] += run["dur"] / 1e6
        while i < len(nodes) and nodes[i]["ts"] < run["ts"]:
            i += 1
        while i < len(nodes) and nodes[i]["ts"] <= run["ts"] + run["dur"]:
            out[kind][nodes[i]["args"]["op_name"]] += nodes[i]["dur"] / 1e6
            i += 1
    result = {kind: dict(sorted(ops.items(), key=lambda kv: -kv[1])) for kind, ops in out.items()}
    result["runs"] = {kind: kinds.count(kind) for kind in ("decode", "prefill")}
    result["run_s"] = run_s
    return result


def op_class(op: str) -> str:
    """Which floor an ORT op type answers to: "matmul" (reads the weights), "attention" (reads the
    cache) or "other" (elementwise, norms, reshapes: no floor of their own)."""
    if "Attention" in op:
        return "attention"
    if "MatMul" in op or op in ("Gemm", "FusedGemm"):
        return "matmul"
    return "other"


def op_breakdown(seconds: dict[str, dict[str, float]], matmul_floor_ms: float, attention_floor_ms: float) -> dict:
    """``op_seconds``' kernel seconds as ms per decode step: per op type, and per class
    (``op_class``) with the class's floor and floor / measured; ``decode_run_ms_per_step`` is the whole
    ORT call (kernels plus ORT's work between them). Prefill stays in seconds (not per step)."""
    steps = max(1, seconds["runs"]["decode"])
    per_op = {op: round(1000 * s / steps, 3) for op, s in seconds["decode"].items()}
    classes: dict[str, dict[str, float | None]] = {}
    for cls, floor in (("matmul", matmul_floor_ms), ("attention", attention_floor_ms), ("other", None)):
        ms = sum(v for op, v in per_op.items() if op_class(op) == cls)
        classes[cls] = {
            "ms": round(ms, 3),
            "floor_ms": round(floor, 3) if floor is not None else None,
            "floor_ratio": round(floor / ms, 3) if floor is not None and ms else None,
        }
    return {
        "decode_steps": seconds["runs"]["decode"],
        "decode_run_ms_per_step": round(1000 * seconds["run_s"]["decode"] / steps, 3),
        "decode_kernel_ms_per_step": round(sum(per_op.values()), 3),
        "decode_classes": classes,
        "decode_op_ms_per_step": per_op,
        "prefill_runs": seconds["runs"]["prefill"],
        "prefill_s": {op: round(s, 4) for op, s in seconds["prefill"].items()},
    }
