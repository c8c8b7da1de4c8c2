"""The trunk's weight matmuls in each library made for CPU inference, behind one small interface, for
``bench kernels`` (``bench/kernels.py``). Family-agnostic: a ``TrunkShape`` is all a family gives.

A backend holds the weights of every layer in its own format and offers two calls on fp32 rows:
``op(name, layer, x)`` (one projection of one layer: torch backends only, where a call is cheap) and
``step(x)`` (the whole chain of a decode step's matmuls: every layer's qkv, o, gate/up and down
projections, with the residual adds and SwiGLU between them, then the output heads). No attention,
no norms, no rotary: those read no weights. ONNX Runtime and OpenVINO run ``step`` as one graph (a
call each, as the engine would); their per-op times come from their own profilers (``op_profile``).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..kernels import openvino

OPS = ("qkv", "oproj", "gateup", "down", "heads")
"""The weight matmuls of a decode step, by the tag each carries in graph node names."""


@dataclass(frozen=True, slots=True)
class TrunkShape:
    hidden: int
    intermediate: int
    layers: int
    qkv_out: int
    """Outputs of the fused q/k/v projection: (heads + 2 * kv heads) * head dim."""
    heads_out: int
    """Outputs of every output head together (one matmul)."""

    def op_shape(self, op: str) -> tuple[int, int]:
        """(out, in) of one op's weight."""
        return {
            "qkv": (self.qkv_out, self.hidden),
            "oproj": (self.hidden, self.hidden),
            "gateup": (2 * self.intermediate, self.hidden),
            "down": (self.hidden, self.intermediate),
            "heads": (self.heads_out, self.hidden),
        }[op]

    def op_count(self, op: str) -> int:
        return 1 if op == "heads" else self.layers

    def params(self, op: str | None = None) -> int:
        ops = OPS if op is None else (op,)
        return sum(self.op_count(o) * self.op_shape(o)[0] * self.op_shape(o)[1] for o in ops)


Weights = dict[str, list[torch.Tensor]]
"""op -> one fp32 [out, in] weight per layer (one for the heads)."""


RESIDUAL_SCALE = 0.1
"""The o and down projections' weights are scaled by this: with unit-variance weights and no norms
the residual stream doubles per block and overflows within 20 layers; scaled, it stays of order 1 (as
a trained model's does), so outputs can be compared. It changes nothing of any kernel's speed."""


def random_weights(shape: TrunkShape, seed: int = 0) -> Weights:
    g = torch.Generator().manual_seed(seed)

    def weight(op: str) -> torch.Tensor:
        out, inp = shape.op_shape(op)
        scale = inp**-0.5 * (RESIDUAL_SCALE if op in ("oproj", "down") else 1.0)
        return torch.randn(out, inp, generator=g) * scale

    return {op: [weight(op) for _ in range(shape.op_count(op))] for op in OPS}


def _chain(
    shape: TrunkShape, linear: Callable[[str, int, torch.Tensor], torch.Tensor], x: torch.Tensor
) -> torch.Tensor:
    """The decode step's matmul chain in torch (the graphs below build the same)."""
    h = x
    for i in range(shape.layers):
        qkv = linear("qkv", i, h)
        h = h + linear("oproj", i, qkv[:, : shape.hidden].contiguous())
        gate, up = linear("gateup", i, h).chunk(2, dim=-1)
        h = h + linear("down", i, (F.silu(gate) * up).contiguous())
    return linear("heads", 0, h)


def reference_chain(shape: TrunkShape, weights: Weights, x: torch.Tensor) -> torch.Tensor:
    """The chain in float64 on the fp32 weights: what each backend's output is compared with."""
    return _chain(shape, lambda op, i, rows: rows @ weights[op][i].double().t(), x.double())


class Backend:
    name: str
    weight_bytes: int
    """Bytes a step reads for its weights in this backend's format (scales included)."""
    note: str = ""

    def step(self, x: torch.Tensor) -> Any:
        raise NotImplementedError

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """``step``'s result as a tensor (the heads' outputs)."""
        return torch.as_tensor(np.asarray(self.step(x)))

    def op(self, op: str, layer: int, x: torch.Tensor) -> Any:  # graph backends have no single-op call
        raise NotImplementedError

    def op_profile(self, x: torch.Tensor, runs: int) -> dict[str, float] | None:
        """ms per step spent in each op (its tag) by the library's own profiler; None: time ``op``."""
        return None


class TorchBackend(Backend):
    def __init__(
        self, name: str, shape: TrunkShape, weights: Weights, make: Callable[[torch.Tensor], tuple[Callable, int]]
    ):
        self.name, self.shape = name, shape
        self.fns: dict[str, list[Callable]] = {}
        self.weight_bytes = 0
        for op, ws in weights.items():
            self.fns[op] = []
            for w in ws:
                fn, nbytes = make(w)
                self.fns[op].append(fn)
                self.weight_bytes += nbytes

    def op(self, op: str, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self.fns[op][layer](x)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        return _chain(self.shape, self.op, x)


# --------------------------------------------------------------------------------------------------
# torch's kernels: each ``make`` takes an fp32 [out, in] weight and gives (fp32 rows -> fp32 rows, bytes)


def make_fp32_mkl(w: torch.Tensor):
    return (lambda x: F.linear(x, w)), w.numel() * 4


def make_onednn(dtype: torch.dtype):
    from ..kernels.linear import pack_weight

    def make(w: torch.Tensor):
        packed = pack_weight(w.to(dtype))
        op = torch.ops.mkldnn._linear_pointwise
        if dtype == torch.float32:
            return (lambda x: op(x, packed, None, "none", [], "")), w.numel() * 4
        return (lambda x: op(x.to(dtype), packed, None, "none", [], "").float()), w.numel() * 2

    return make


def make_int8_weight(act: torch.dtype):
    from ..kernels.quant import quantize_weight

    def make(w: torch.Tensor):
        q, scale = quantize_weight(w)
        s = scale.to(act)
        mm = torch.ops.aten._weight_int8pack_mm
        if act == torch.float32:
            return (lambda x: mm(x, q, s)), q.numel() + s.numel() * 4
        return (lambda x: mm(x.to(act), q, s).float()), q.numel() + s.numel() * 2

    return make


def make_fbgemm_static(w: torch.Tensor):
    """int8-static's kernel with a fixed activation range (not calibrated: values past it saturate,
    which changes nothing of its speed)."""
    from torch import nn

    from ..kernels.quant import StaticInt8Linear

    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data = w
    mod = StaticInt8Linear(lin, absmax=4.0)
    return mod, w.numel() + w.shape[0] * 4


def make_int4pack(group: int, act: torch.dtype):
    from ..kernels.int4_cpu import int4_linear, pack_int4

    def make(w: torch.Tensor):
        packed = pack_int4(w, group, act)
        return (lambda x: int4_linear(x, packed)), packed.nbytes

    return make


def make_int4_gemv(block: int, scale_dtype: torch.dtype):
    from ..kernels.int4_gemv import available, linear, pack

    def make(w: torch.Tensor):
        if not available():  # not its dense fallback: that would time torch's fp32 matmul
            raise RuntimeError("the int4 GEMV kernel does not run here")
        packed = pack(w, block, scale_dtype)
        return (lambda x: linear(x, packed)), packed.nbytes

    return make


def torch_backends(shape: TrunkShape, weights: Weights, names: set[str] | None) -> dict[str, Callable[[], Backend]]:
    """Builders (lazy: each holds its own copy of the weights) of torch's backends, by name."""
    from ..kernels import int4_cpu, int4_gemv
    from ..kernels.linear import packing_available

    makers: dict[str, Callable] = {"torch-fp32": make_fp32_mkl, "onednn-fp32": make_onednn(torch.float32)}
    if packing_available(torch.device("cpu"), torch.bfloat16):
        makers["onednn-bf16"] = make_onednn(torch.bfloat16)
    makers["int8w-bf16"] = make_int8_weight(torch.bfloat16)
    makers["int8w-fp32"] = make_int8_weight(torch.float32)
    if "fbgemm" in torch.backends.quantized.supported_engines:
        makers["fbgemm-int8-static"] = make_fbgemm_static
    if int4_cpu.available():
        for g in (32, 128):
            makers[f"int4pack-g{g}-fp32"] = make_int4pack(g, torch.float32)
            makers[f"int4pack-g{g}-bf16"] = make_int4pack(g, torch.bfloat16)
    if int4_gemv.cpu_supported() and (names is None or any(n.startswith("cpp-int4") for n in names)):
        for b in (32, 128):  # the hand-written GEMV (built on first use): fp32 or bf16 block scales
            makers[f"cpp-int4-b{b}"] = make_int4_gemv(b, torch.float32)
            makers[f"cpp-int4-b{b}-bf16s"] = make_int4_gemv(b, torch.bfloat16)
    return {
        n: (lambda n=n, m=m: TorchBackend(n, shape, weights, m))
        for n, m in makers.items()
        if names is None or n in names
    }


# --------------------------------------------------------------------------------------------------
# One ONNX graph of the chain, for ONNX Runtime (its quantizers) and OpenVINO (read, then nncf)


def write_onnx_chain(shape: TrunkShape, weights: Weights, directory: Path) -> Path:
    """The step's matmul chain as ``directory/model.onnx`` (+ external data); MatMul nodes are named
    ``{tag}_L{layer}`` so profiles can be split by op. Returns the graph's path."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from ..kernels.onnx_runtime import MODEL_FILE, save_model

    nodes, inits = [], []

    def matmul(op: str, layer: int, x: str) -> str:
        w = f"W_{op}_L{layer}"
        inits.append(numpy_helper.from_array(weights[op][layer].t().contiguous().numpy(), w))
        out = f"{op}_L{layer}_out"
        nodes.append(helper.make_node("MatMul", [x, w], [out], name=f"{op}_L{layer}"))
        return out

    def const(name: str, values: list[int]) -> str:
        inits.append(numpy_helper.from_array(np.array(values, dtype=np.int64), name))
        return name

    h = "x"
    const("s0", [0])
    const("sh", [shape.hidden])
    const("s1", [1])
    const("split", [shape.intermediate, shape.intermediate])
    for i in range(shape.layers):
        qkv = matmul("qkv", i, h)
        q = f"q_L{i}"
        nodes.append(helper.make_node("Slice", [qkv, "s0", "sh", "s1"], [q], name=f"slice_L{i}"))
        o = matmul("oproj", i, q)
        nodes.append(helper.make_node("Add", [h, o], [f"h1_L{i}"], name=f"add1_L{i}"))
        gu = matmul("gateup", i, f"h1_L{i}")
        nodes.append(helper.make_node("Split", [gu, "split"], [f"g_L{i}", f"u_L{i}"], axis=1, name=f"split_L{i}"))
        nodes.append(helper.make_node("Sigmoid", [f"g_L{i}"], [f"sg_L{i}"], name=f"sig_L{i}"))
        nodes.append(helper.make_node("Mul", [f"g_L{i}", f"sg_L{i}"], [f"silu_L{i}"], name=f"silu_L{i}"))
        nodes.append(helper.make_node("Mul", [f"silu_L{i}", f"u_L{i}"], [f"m_L{i}"], name=f"mul_L{i}"))
        d = matmul("down", i, f"m_L{i}")
        nodes.append(helper.make_node("Add", [f"h1_L{i}", d], [f"h_L{i}"], name=f"add2_L{i}"))
        h = f"h_L{i}"
    out = matmul("heads", 0, h)
    graph = helper.make_graph(
        nodes,
        "trunk_matmul_chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", shape.hidden])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["rows", shape.heads_out])],
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    directory.mkdir(parents=True, exist_ok=True)
    save_model(model, directory)
    onnx.checker.check_model(str(directory / MODEL_FILE))
    return directory / MODEL_FILE


def _tag(node_name: str) -> str:
    for op in OPS:
        if node_name.startswith(op + "_") or f"/{op}_" in node_name or f"{op}_L" in node_name:
            return op
    return "other"


def _data_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


class OrtBackend(Backend):
    def __init__(self, name: str, directory: Path, note: str = ""):
        import onnxruntime as ort

        from ..kernels.onnx_runtime import MODEL_FILE

        self.name, self.note, self.directory = name, note, directory
        self.weight_bytes = _data_bytes(directory) - (directory / MODEL_FILE).stat().st_size
        self.sess = self._session(ort, profile=False)
        self.out = self.sess.get_outputs()[0].name

    def _session(self, ort, profile: bool):
        from ..kernels.onnx_runtime import MODEL_FILE

        so = ort.SessionOptions()
        so.intra_op_num_threads = torch.get_num_threads()
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        if profile:
            so.enable_profiling = True
            so.profile_file_prefix = str(Path(tempfile.gettempdir()) / f"kernels_{os.getpid()}")
        return ort.InferenceSession(str(self.directory / MODEL_FILE), so, providers=["CPUExecutionProvider"])

    def step(self, x: torch.Tensor) -> Any:
        return self.sess.run([self.out], {"x": x.numpy()})[0]

    def op_profile(self, x: torch.Tensor, runs: int) -> dict[str, float]:
        import onnxruntime as ort

        sess = self._session(ort, profile=True)
        feed = {"x": x.numpy()}
        sess.run(None, feed)  # warm-up, left out below
        sess.run(None, feed)
        path = Path(sess.end_profiling())
        sess = self._session(ort, profile=True)
        for _ in range(runs):
            sess.run(None, feed)
        path.unlink(missing_ok=True)
        path = Path(sess.end_profiling())
        events = json.loads(path.read_text())
        path.unlink(missing_ok=True)
        ms: dict[str, float] = defaultdict(float)
        for e in events:
            if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
                ms[_tag(e["name"][: -len("_kernel_time")])] += e["dur"] / 1000 / runs
        return dict(ms)


def ort_backends(
    shape: TrunkShape, fp32_dir: Path, work: Path, names: set[str] | None
) -> dict[str, Callable[[], Backend]]:
    """ORT's CPU paths: fp32; int8 (``quantize_dynamic``: per-channel weights, activations per call,
    the ort-int8 mode); ``MatMulNBits`` 4-bit at block sizes 32/64/128 and accuracy levels 1 (fp32
    activations) and 4 (int8 activations per block)."""
    import onnx

    from ..kernels import onnx_quant
    from ..kernels.onnx_runtime import MODEL_FILE, save_model

    def quantized(kind: str, block: int = 32, level: int = 4) -> Path:
        d = work / (f"ort-{kind}" if kind != "int4" else f"ort-int4-b{block}-a{level}")
        if not (d / MODEL_FILE).exists():
            d.mkdir(parents=True, exist_ok=True)
            base = work / f"ort-int4-b{block}-a4"
            if kind == "int4" and level != 4 and (base / MODEL_FILE).exists():
                model = onnx.load(str(base / MODEL_FILE))  # only the attribute differs
                for node in model.graph.node:
                    if node.op_type == "MatMulNBits":
                        for a in node.attribute:
                            if a.name == "accuracy_level":
                                a.i = level
                save_model(model, d)
            else:
                onnx_quant.quantize(
                    fp32_dir, d, kind, onnx_quant.int8_reduce_range(), block_size=block, accuracy_level=level
                )
        return d

    specs: dict[str, Callable[[], Path]] = {"ort-fp32": lambda: fp32_dir, "ort-int8": lambda: quantized("int8")}
    for block in (32, 64, 128):
        for level in (4, 1):
            specs[f"ort-int4-b{block}-a{level}"] = lambda b=block, lv=level: quantized("int4", b, lv)
    return {n: (lambda n=n, f=f: OrtBackend(n, f())) for n, f in specs.items() if names is None or n in names}


class OpenVinoBackend(Backend):
    def __init__(self, name: str, onnx_path: Path, compress: dict | None, hint: str | None):
        import openvino as ov

        core = ov.Core()
        model = core.read_model(str(onnx_path))
        if compress is not None:
            import nncf

            mode = getattr(nncf.CompressWeightsMode, compress["mode"])
            kw = {"group_size": compress["group"], "ratio": 1.0, "all_layers": True} if "group" in compress else {}
            model = nncf.compress_weights(model, mode=mode, **kw)
        self.weight_bytes = sum(op.get_byte_size() for op in model.get_ops() if op.get_type_name() == "Constant")
        if compress is None and hint == "bf16":
            self.weight_bytes //= 2  # the plugin holds fp32 weights as bf16 when it computes in bf16
        config = {"INFERENCE_NUM_THREADS": torch.get_num_threads(), "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY"}
        if hint:
            config["INFERENCE_PRECISION_HINT"] = hint
        self.compiled = openvino.compile_model(model, config, core)
        self.request = self.compiled.create_infer_request()
        self.name = name
        self.note = f"activations {self.compiled.get_property('INFERENCE_PRECISION_HINT')}"
        self.core, self.model, self.config = core, model, config

    def step(self, x: torch.Tensor) -> Any:
        return self.request.infer({0: x.numpy()})

    def output(self, x: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(np.array(self.step(x)[0]))

    def op_profile(self, x: torch.Tensor, runs: int) -> dict[str, float]:
        compiled = openvino.compile_model(self.model, {**self.config, "PERF_COUNT": True}, self.core)
        req = compiled.create_infer_request()
        req.infer({0: x.numpy()})
        ms: dict[str, float] = defaultdict(float)
        for _ in range(runs):
            req.infer({0: x.numpy()})
            for info in req.get_profiling_info():
                ms[_tag(info.node_name)] += info.real_time.total_seconds() * 1000 / runs
        return dict(ms)


def openvino_backends(onnx_path: Path, names: set[str] | None) -> dict[str, Callable[[], Backend]]:
    """OpenVINO's CPU plugin on the same graph: fp32 and bf16 weights and activations, and weights
    compressed by nncf (int8 per channel; int4 symmetric in groups of 32 or 128), which the plugin runs
    as FullyConnected with compressed weights (activations quantised per group where it chooses to)."""
    try:
        import openvino  # noqa: F401
    except ImportError:
        return {}
    specs: dict[str, tuple[dict | None, str | None]] = {
        "ov-fp32": (None, "f32"),
        "ov-bf16": (None, "bf16"),
        "ov-int8": ({"mode": "INT8_ASYM"}, None),
        "ov-int8-f32act": ({"mode": "INT8_ASYM"}, "f32"),
        "ov-int4-g32": ({"mode": "INT4_SYM", "group": 32}, None),
        "ov-int4-g128": ({"mode": "INT4_SYM", "group": 128}, None),
    }
    return {
        n: (lambda n=n, c=c, h=h: OpenVinoBackend(n, onnx_path, c, h))
        for n, (c, h) in specs.items()
        if names is None or n in names
    }
