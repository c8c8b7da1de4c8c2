"""The GPT trunk as an ONNX graph for ONNX Runtime (the ``ort-*`` precisions), written from the weights.

The graph is built node by node from the loaded fp32 weights instead of traced from ``model.gpt``:
the step we want is not one torch can trace. Attention is ORT's ``GroupQueryAttention`` contrib op,
which reads and writes the engine's KV slot cache **in place** (past and present bound to the same
buffer), scores only each row's own ``seqlens_k + 1`` keys, applies the rotary embedding itself and
lets an idle row (``query_seqlens = 0``) through untouched. So a decode step passes the cache as
per-layer inputs with no per-step copy, and one graph serves prefill (B rows of up to S tokens, right-
padded; positions past a row's ``query_seqlens`` come out as zeros) and decode (B rows, one token each).

Graph (names are the ONNX input/output names)::

    embeds [B, S, hidden] float32          the summed input embeddings (computed in torch)
    seqlens_k [B] int32                    cached positions after this step, minus 1
    total_sequence_length [] int32         max(seqlens_k) + 1 (an upper bound, see the op's doc)
    query_seqlens [B] int32                new tokens per row (0: idle row, left as it is)
    past_key_{i}, past_value_{i}           [B, kv_heads, capacity, head_dim] float32 per layer
    -> hidden [B, S, hidden]               final-norm hidden states
    -> present_key_{i}, present_value_{i}  the same buffers as past (bind them to the same memory)

Per layer: RMSNorm (``SimplifiedLayerNormalization``; later ones fused with the residual add as
``SkipSimplifiedLayerNormalization``), one q/k/v MatMul, GQA (rotate-half RoPE from fp32 cos/sin
tables, the same values ``model.gpt`` uses), o_proj MatMul, SwiGLU with one gate/up MatMul. The
weights are the only thing the quantizers change: ``int8`` is ``quantize_dynamic`` (QInt8 weights,
per output channel, 7 bits on x86 CPUs without VNNI: see ``int8_reduce_range``; uint8 activations
quantised per call), ``int4`` is ``MatMulNBits`` (4-bit, block 32, symmetric, ``accuracy_level=4``:
int8 activations per block of 32 inside each row).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .checkpoint import GPT_CONFIG, GPT_WEIGHTS, LoadedModel
from .config import GPTConfig
from .gpt import GPT, rope_inv_freq

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2
"""Bump when the graph changes: cached exports of older versions are then ignored."""
OPSET = 21
WEIGHT_KINDS = ("fp32", "int8", "int4")
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
MANIFEST = "manifest.json"
INT4_BLOCK_SIZE = 32


@dataclass(frozen=True, slots=True)
class Manifest:
    """What an export holds; written next to ``model.onnx`` and checked when it is loaded."""

    format_version: int
    weights: str
    """fp32 | int8 | int4"""
    checkpoint_sha256: str
    """sha256 of the checkpoint's GPT weights and config (``checkpoint_digest``)."""
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    """Rows of the rotary tables: the largest cache position the graph can encode."""
    onnxruntime_version: str
    int8_reduce_range: bool = False
    """int8 weights use 7 bits (``int8_reduce_range``)."""

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        path = Path(directory) / MANIFEST
        try:
            raw = json.loads(path.read_text())
            return cls(**raw)
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(f"{path}: not an ONNX export of chattts-serve ({exc})") from None

    def check(self, cfg: GPTConfig, weights: str) -> None:
        want = {
            "format_version": FORMAT_VERSION,
            "weights": weights,
            "hidden_size": cfg.hidden_size,
            "num_layers": cfg.num_layers,
            "num_heads": cfg.num_heads,
            "num_kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
        }
        got = asdict(self)
        diff = {k: (got[k], v) for k, v in want.items() if got[k] != v}
        if diff:
            raise ValueError(f"ONNX export does not fit this model: {diff} (found, wanted)")


def require_onnxruntime() -> None:
    """Raise ValueError with the install hint when ONNX Runtime (or onnx) is missing."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError as exc:
        raise ValueError(
            f"the ort-* precisions need ONNX Runtime ({exc.name} is not installed): pip install 'chattts-serve[onnx]'"
        ) from None


# --------------------------------------------------------------------------------------------------
# Cache keys


def checkpoint_digest(root: Path) -> str:
    """sha256 over the GPT trunk's files (weights + config.json): what an export depends on."""
    h = hashlib.sha256()
    for rel in (GPT_CONFIG, GPT_WEIGHTS):
        path = Path(root) / rel
        if path.exists():
            h.update(rel.encode())
            with open(path, "rb") as f:
                h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()


def default_cache_dir() -> Path:
    import platformdirs

    return platformdirs.user_cache_path("chattts-serve", appauthor=False) / "onnx"


def cache_key(digest: str, weights: str, reduce_range: bool = False) -> str:
    import onnxruntime

    # The ORT version is in the key because its quantizers write the int8/int4 graphs.
    tag = "int8r7" if weights == "int8" and reduce_range else weights
    return f"{digest[:32]}-{tag}-v{FORMAT_VERSION}-ort{onnxruntime.__version__}"


def int8_reduce_range(cpuinfo: str | None = None) -> bool:
    """Whether int8 weights should keep to 7 bits on this CPU. ORT's x86 u8 x s8 kernel without VNNI
    (AVX2's vpmaddubsw) adds pairs of products into int16, which full-range weights can overflow
    (2 x 255 x 127 > 32767); 7-bit weights cannot. VNNI (AVX-512 or AVX) and Arm's dot products
    accumulate in int32: full 8 bits there. Unknown CPUs get the safe choice."""
    import platform

    if platform.machine().lower() in ("aarch64", "arm64"):
        return False
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return True
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return not ({"avx512_vnni", "avx_vnni"} & set(flags))


# --------------------------------------------------------------------------------------------------
# The graph


def _layer_weights(gpt: GPT, i: int) -> dict[str, torch.Tensor]:
    """fp32 [in, out] MatMul weights of layer i (fused or not) and its two norm weights."""
    layer = gpt.layers[i]
    a, m = layer.self_attn, layer.mlp
    if a.qkv_proj is not None:
        qkv = a.qkv_proj.weight
    else:
        qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
    gate_up = m.gate_up_proj.weight if m.gate_up_proj is not None else torch.cat([m.gate_proj.weight, m.up_proj.weight])
    for name, w in (("qkv", qkv), ("gate_up", gate_up)):
        if not isinstance(w, torch.Tensor) or w.dtype != torch.float32:
            raise ValueError(f"layer {i} {name}: export needs the fp32 model as loaded (got {type(w).__name__})")
    return {
        "qkv": qkv.detach().t(),
        "o": a.o_proj.weight.detach().t(),
        "gate_up": gate_up.detach().t(),
        "down": m.down_proj.weight.detach().t(),
        "input_norm": layer.input_layernorm.weight.detach(),
        "post_norm": layer.post_attention_layernorm.weight.detach(),
    }


def rope_tables(cfg: GPTConfig, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, head_dim / 2]: the values ``model.gpt.rope_cos_sin`` computes (fp32)."""
    freqs = torch.arange(max_positions).float()[:, None] * rope_inv_freq(cfg.head_dim, cfg.rope_theta).float()
    return freqs.cos(), freqs.sin()


_GQA_INPUTS = (
    "query",
    "key",
    "value",
    "past_key",
    "past_value",
    "seqlens_k",
    "total_sequence_length",
    "cos_cache",
    "sin_cache",
    "position_ids",
    "attention_bias",
    "head_sink",
    "k_scale",
    "v_scale",
    "q_norm_weight",
    "k_norm_weight",
    "query_seqlens",
)
"""GroupQueryAttention's inputs in order (ORT 1.32 schema); optional ones left out are ``""``."""


def _gqa_inputs(**given: str) -> list[str]:
    unknown = set(given) - set(_GQA_INPUTS)
    if unknown:
        raise ValueError(f"not GroupQueryAttention inputs: {sorted(unknown)}")
    names = [given.get(n, "") for n in _GQA_INPUTS]
    while names and not names[-1]:
        names.pop()
    return names


def build_graph(gpt: GPT, max_positions: int | None = None):
    """The fp32 trunk step as an ``onnx.ModelProto`` (weights as initializers)."""
    from onnx import TensorProto, helper, numpy_helper

    cfg = gpt.cfg
    max_positions = max_positions or cfg.max_position_embeddings
    nodes: list = []
    inits: list = []

    def init(name: str, t: torch.Tensor) -> str:
        t = t.detach().float() if t.is_floating_point() else t
        inits.append(numpy_helper.from_array(t.contiguous().numpy(), name))
        return name

    def node(op: str, inputs: list[str], outputs: list[str], domain: str = "", **attrs) -> list[str]:
        nodes.append(helper.make_node(op, inputs, outputs, name=outputs[0] + "_node", domain=domain, **attrs))
        return outputs

    eps = cfg.rms_norm_eps
    cos, sin = rope_tables(cfg, max_positions)
    init("rope_cos", cos)
    init("rope_sin", sin)
    split = init("gate_up_split", torch.tensor([cfg.intermediate_size] * 2, dtype=torch.int64))

    batch, seq, cap = "batch", "seq", "capacity"
    kv_shape = [batch, cfg.num_kv_heads, cap, cfg.head_dim]
    inputs = [
        helper.make_tensor_value_info("embeds", TensorProto.FLOAT, [batch, seq, cfg.hidden_size]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [batch]),
        helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
        helper.make_tensor_value_info("query_seqlens", TensorProto.INT32, [batch]),
    ]
    outputs = [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [batch, seq, cfg.hidden_size])]

    # Positions past a row's query_seqlens (an idle row's every position; a short prompt's right
    # padding in a batched prefill) get an unspecified attention output from the op; zero it, so that
    # they stay exact zeros and never reach a neighbour (int8's per-call activation scale sees them).
    node("Shape", ["embeds"], ["seq_len_1"], start=1, end=2)  # [S]
    node("Squeeze", ["seq_len_1"], ["seq_len"])
    node("Cast", ["seq_len"], ["seq_len_i32"], to=TensorProto.INT32)
    zero_i32 = init("zero_i32", torch.zeros((), dtype=torch.int32))
    node("Range", [zero_i32, "seq_len_i32", init("one_i32", torch.ones((), dtype=torch.int32))], ["positions"])
    node("Unsqueeze", ["query_seqlens", init("axes_1", torch.ones(1, dtype=torch.int64))], ["qs_col"])  # [B, 1]
    node("Less", ["positions", "qs_col"], ["active_2d"])  # [B, S]
    node("Unsqueeze", ["active_2d", init("axes_2", torch.tensor([2]))], ["active"])  # [B, S, 1]
    zero = init("zero_f32", torch.zeros(()))

    h = "embeds"  # the residual stream
    pending: str | None = None  # the last block's output, not yet added to h
    for i in range(cfg.num_layers):
        w = _layer_weights(gpt, i)
        p = f"l{i}_"
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_{kind}_{i}", TensorProto.FLOAT, kv_shape))
            outputs.append(helper.make_tensor_value_info(f"present_{kind}_{i}", TensorProto.FLOAT, kv_shape))
        norm_w = init(p + "input_norm", w["input_norm"])
        if pending is None:
            (x,) = node("SimplifiedLayerNormalization", [h, norm_w], [p + "x"], axis=-1, epsilon=eps)
        else:
            x, _, _, h = node(
                "SkipSimplifiedLayerNormalization",
                [pending, h, norm_w],
                [p + "x", p + "mean0", p + "inv_std0", p + "h0"],
                domain="com.microsoft",
                epsilon=eps,
            )
        (qkv,) = node("MatMul", [x, init(p + "qkv", w["qkv"])], [p + "qkv_out"])
        attn, _, _ = node(
            "GroupQueryAttention",
            _gqa_inputs(
                query=qkv,  # packed q, k, v
                past_key=f"past_key_{i}",
                past_value=f"past_value_{i}",
                seqlens_k="seqlens_k",
                total_sequence_length="total_sequence_length",
                cos_cache="rope_cos",
                sin_cache="rope_sin",
                query_seqlens="query_seqlens",
            ),
            [p + "attn", f"present_key_{i}", f"present_value_{i}"],
            domain="com.microsoft",
            num_heads=cfg.num_heads,
            kv_num_heads=cfg.num_kv_heads,
            do_rotary=1,
            rotary_interleaved=0,
            scale=cfg.head_dim**-0.5,
        )
        (attn,) = node("Where", ["active", attn, zero], [p + "attn_active"])
        (o,) = node("MatMul", [attn, init(p + "o", w["o"])], [p + "o_out"])
        x, _, _, h = node(
            "SkipSimplifiedLayerNormalization",
            [o, h, init(p + "post_norm", w["post_norm"])],
            [p + "x1", p + "mean1", p + "inv_std1", p + "h1"],
            domain="com.microsoft",
            epsilon=eps,
        )
        (gu,) = node("MatMul", [x, init(p + "gate_up", w["gate_up"])], [p + "gu"])
        gate, up = node("Split", [gu, split], [p + "gate", p + "up"], axis=-1)
        (sig,) = node("Sigmoid", [gate], [p + "sig"])
        (silu,) = node("Mul", [gate, sig], [p + "silu"])
        (act,) = node("Mul", [silu, up], [p + "act"])
        (pending,) = node("MatMul", [act, init(p + "down", w["down"])], [p + "down_out"])
    node(
        "SkipSimplifiedLayerNormalization",
        [pending, h, init("final_norm", gpt.norm.weight.detach())],
        ["hidden"],
        domain="com.microsoft",
        epsilon=eps,
    )
    graph = helper.make_graph(nodes, "chattts_gpt_step", inputs, outputs, inits)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)],
        producer_name="chattts-serve",
    )
    model.ir_version = 10  # onnx's checker knows none of ORT's contrib ops: ORT checks at load
    return model


# --------------------------------------------------------------------------------------------------
# Writing an export


def _save(model, directory: Path) -> None:
    import onnx

    onnx.save_model(
        model,
        str(directory / MODEL_FILE),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=DATA_FILE,
        size_threshold=1024,
    )


def _nbits_quantizer():
    """``MatMulNBitsQuantizer``, imported without letting the module's ``logging.basicConfig`` (run at
    import) configure the application's root logger."""
    root = logging.getLogger()
    guard = logging.NullHandler()
    root.addHandler(guard)  # basicConfig does nothing when the root logger has a handler
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    finally:
        root.removeHandler(guard)
    return MatMulNBitsQuantizer


def _quantize(src: Path, dst: Path, weights: str, reduce_range: bool) -> None:
    """Quantize ``src``'s MatMul weights into ``dst`` (both directories holding ``model.onnx``)."""
    # The quantizers log every node at INFO, and quantize_dynamic advises pre-processing (for CNNs).
    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    root = logging.getLogger()
    advice = _DropMessage("Please consider to run pre-processing")
    root.addFilter(advice)
    try:
        _run_quantizer(src, dst, weights, reduce_range)
    finally:
        root.removeFilter(advice)


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def _run_quantizer(src: Path, dst: Path, weights: str, reduce_range: bool) -> None:
    import onnx

    if weights == "int8":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantized = src / "int8.onnx"  # it names its own data file; re-saved below under ours
        quantize_dynamic(
            str(src / MODEL_FILE),
            str(quantized),
            op_types_to_quantize=["MatMul"],
            weight_type=QuantType.QInt8,  # QUInt8 weights measured slower at 32 rows (issue 12)
            per_channel=True,
            reduce_range=reduce_range,
            use_external_data_format=True,
            # onnx's shape inference stops at ORT's contrib ops; every tensor of the graph is fp32.
            extra_options={"MatMulConstBOnly": True, "DefaultTensorType": onnx.TensorProto.FLOAT},
        )
        _save(onnx.load(str(quantized)), dst)
    elif weights == "int4":
        quant = _nbits_quantizer()(
            onnx.load(str(src / MODEL_FILE)),
            bits=4,
            block_size=INT4_BLOCK_SIZE,
            is_symmetric=True,
            accuracy_level=4,  # int8 activations: 1.6x faster than fp32 activations (issue 12)
        )
        quant.process()
        _save(quant.model.model, dst)
    else:
        raise ValueError(f"unknown weight kind {weights!r}; expected one of {', '.join(WEIGHT_KINDS)}")


def export(
    model: LoadedModel,
    out: str | os.PathLike,
    weights: str = "fp32",
    digest: str | None = None,
    reduce_range: bool | None = None,
) -> Path:
    """Write the trunk of ``model`` (fp32, as loaded) as an ONNX export to directory ``out``:
    ``model.onnx`` + ``model.onnx.data`` + ``manifest.json``. Returns ``out``. ``reduce_range``: 7-bit
    int8 weights (None: ``int8_reduce_range()`` for this CPU; ignored for fp32 and int4)."""
    require_onnxruntime()
    import onnxruntime

    if weights not in WEIGHT_KINDS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_KINDS)}; got {weights!r}")
    reduce_range = int8_reduce_range() if reduce_range is None else reduce_range
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in (MANIFEST, MODEL_FILE, DATA_FILE):  # onnx appends to an existing data file
        (out / name).unlink(missing_ok=True)
    cfg = model.config.gpt
    start = time.perf_counter()
    graph = build_graph(model.gpt)
    if weights == "fp32":
        _save(graph, out)
    else:
        with tempfile.TemporaryDirectory(dir=out) as tmp:
            _save(graph, Path(tmp))
            del graph
            _quantize(Path(tmp), out, weights, reduce_range)
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        weights=weights,
        checkpoint_sha256=digest or checkpoint_digest(model.root),
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_positions=cfg.max_position_embeddings,
        onnxruntime_version=onnxruntime.__version__,
        int8_reduce_range=weights == "int8" and reduce_range,
    )
    (out / MANIFEST).write_text(json.dumps(asdict(manifest), indent=2) + "\n")
    logger.info("exported the GPT trunk (%s) to %s in %.1f s", weights, out, time.perf_counter() - start)
    return out


def cached_export(model: LoadedModel, weights: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The export of ``model``'s trunk with ``weights``, from the cache (``cache_dir``, default the user
    cache dir) or written there first. Keyed by the checkpoint's digest, the weight kind, the graph
    format and the ONNX Runtime version, so an engine start re-exports only when one of them changed."""
    require_onnxruntime()
    base = Path(cache_dir) if cache_dir else default_cache_dir()
    digest = checkpoint_digest(model.root)
    reduce_range = weights == "int8" and int8_reduce_range()
    final = base / cache_key(digest, weights, reduce_range)
    if (final / MANIFEST).exists():
        logger.info("ONNX export from the cache: %s", final)
        return final
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".export-", dir=base))
    try:
        export(model, tmp, weights, digest, reduce_range)
        try:
            os.replace(tmp, final)  # atomic: a reader sees a whole export or none
        except OSError:
            if not (final / MANIFEST).exists():  # not a concurrent writer that got there first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
