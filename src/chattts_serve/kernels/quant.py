"""Precision modes of the GPT trunk: float dtypes and int8 weights, applied as a module swap after load.

A mode is chosen by name in config (``EngineConfig.precision``), never guessed from file names: the official files
are fp32 and every mode starts from them. Norms, rotary, softmax, the output heads and sampling stay
in fp32 in every mode (RMSNorm upcasts; the heads and the sampler run on ``.float()`` hidden states).

=============  ==========  ==================================================  ===========================
mode           residual    matmul                                              devices
=============  ==========  ==================================================  ===========================
fp32           fp32        fp32 (oneDNN-packed on CPU when batching)           cpu, cuda
bf16           bf16        bf16 (oneDNN-packed where the CPU has bf16 units)   cpu, cuda
fp16           fp16        fp16                                                cuda
int8           bf16        int8 weights, per-output-channel scales, bf16 act.  cpu, cuda
int8-dynamic   fp32        int8 weights, activations quantised per call        cpu (fbgemm)
int8-static    fp32        int8 weights, activation scales calibrated on text  cpu (fbgemm)
int4           fp32        4-bit weights (block 128, bf16 scales), int8 act.   cpu (AVX-512 VNNI C++ op)
                           per row and block; KV cache bf16 by default
ort-fp32       fp32        the trunk in ONNX Runtime, fp32                     cpu (onnxruntime)
ort-int8       fp32        ORT, int8 weights per channel, act. per call        cpu (onnxruntime)
ort-int4       fp32        ORT, 4-bit weights (block 32), int8 act. per block  cpu (onnxruntime)
ort-int4-b128  fp32        ORT, 4-bit weights (block 128), int8 act. per block cpu (onnxruntime)
ort-auto       fp32        ORT, ort-int4 below a row crossover, ort-int8 above  cpu (onnxruntime)
=============  ==========  ==================================================  ===========================

Why three int8 modes: on CPUs without AVX-512 VNNI/AMX (our CI box is AVX2), torch's weight-only int8
GEMV (``_weight_int8pack_mm``) is only as fast as a bf16 GEMV, while fbgemm's u8 x s8 kernels read int8
weights at nearly the bandwidth floor. fbgemm needs int8 activations: "dynamic" takes one scale per
call from the whole batch (so a row's result depends on its neighbours: not batch-invariant),
"static" fixes one scale per layer from calibration text (batch-invariant, and a little faster).

int4: every GPT projection (fused qkv, o, fused gate/up, down) on ``kernels.int4_gemv``, the hand-written
AVX-512 VNNI kernel that reads 4-bit weights at ~0.7 of the memory's rate at 1-8 rows, where ONNX Runtime's
``MatMulNBits`` reads at ~0.55 (issue 33). Calls wider than 8 rows (prefill, many slots) run on the same
kernel and packed weights, one pass over the weights per 8 rows: the same arithmetic for a row at any
width (batch-invariant, prefill included) and no second copy of the weights; what it costs against a
dequantising GEMM at wide calls is in BENCHMARKS.md. The kernel takes fp32 activations and quantises them
to int8 per row and block of 128 itself. Its KV cache is int8 (one fp32 scale a vector: ``kernels.kv_int8``)
where the C++ decode attention runs (an AVX-512 CPU: ``kernels.decode_attention``): 0.53 of a bf16 cache's
bytes at no cost ``eval`` resolves (int4/kv-int8 against int4/kv-bf16: top-1 0.8619 and 0.8613, KL 0.00432
both), 6-15 % more 32-stream throughput on the Zen 5 (BENCHMARKS.md, ninth session).
Its decode step runs every layer in one C++ call (``kernels.int4_decode``: the same bits as the torch ops,
without their ~5 ms a step of dispatch and Python). Its code heads run as one bf16 matrix
(``models.chattts.prepare``, ``Embed.pack_heads``). Without AVX-512 VNNI or a compiler the weights run
dequantised in fp32 (``int4_gemv.pack``; one warning).

The ``ort-*`` modes leave the torch trunk alone: ``models.chattts.prepare`` exports it to ONNX (cached) and the
runner steps it in ONNX Runtime over the same KV slot cache (``models.chattts.onnx_export``,
``models.chattts.onnx_trunk``).
ort-int8's weights keep to 7 bits on x86 CPUs without VNNI (``onnx_quant.int8_reduce_range``).
ort-int4-b128: the same kernel with coarser scales, 1.2-1.5x faster at 1-8 rows (issue 33).
Batch invariance: ort-fp32 and ort-int4 (either block) keep it (MLAS computes each row the same at any row count;
checked by the tests), ort-int8 does not (one activation scale per call, as int8-dynamic), nor does
ort-auto (the kernel, hence a request's codes, follows the rows in each call: ``models.chattts.onnx_auto``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from . import int4_gemv
from .linear import on_rows, swap_linears_
from .precisions import PRECISIONS


@dataclass(frozen=True, slots=True)
class PrecisionSpec:
    name: str
    trunk_dtype: torch.dtype
    """dtype of the GPT residual stream and of its KV cache."""
    int8: Literal["none", "weight", "dynamic", "static"]
    onnx: Literal["fp32", "int8", "int4", "int4-b128", "auto"] | None = None
    """The trunk runs in ONNX Runtime with these weights (``ort-*``; "auto": int4 or int8 by the
    width of each call, ``models.chattts.onnx_auto``); None: in torch."""
    int4: bool = False
    """The projections run on ``kernels.int4_gemv`` (``Int4GemvLinear``)."""
    cpu_kv_dtype: torch.dtype | None = None
    """The KV cache under ``kv_cache_dtype`` auto on a CPU with the C++ decode attention (None: the trunk's)."""


_MODES = {  # name -> (trunk dtype, int8 kind, ONNX weights[, int4 GEMV, CPU KV cache]); kernels.precisions.PRECISIONS
    "fp32": (torch.float32, "none", None),
    "bf16": (torch.bfloat16, "none", None),
    "fp16": (torch.float16, "none", None),
    "int8": (torch.bfloat16, "weight", None),
    "int8-dynamic": (torch.float32, "dynamic", None),
    "int8-static": (torch.float32, "static", None),
    "int4": (torch.float32, "none", None, True, torch.int8),
    "ort-fp32": (torch.float32, "none", "fp32"),
    "ort-int8": (torch.float32, "none", "int8"),
    "ort-int4": (torch.float32, "none", "int4"),
    "ort-int4-b128": (torch.float32, "none", "int4-b128"),
    "ort-auto": (torch.float32, "none", "auto"),
}
assert tuple(_MODES) == PRECISIONS
SPECS = {name: PrecisionSpec(name, *_MODES[name]) for name in PRECISIONS}


def parse_precision(name: str) -> PrecisionSpec:
    """The spec of a mode name (one of ``PRECISIONS``)."""
    if name not in SPECS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {name!r}")
    return SPECS[name]


def check_supported(spec: PrecisionSpec, device: torch.device) -> None:
    """Raise ValueError with the reason when ``spec`` cannot run on ``device``."""
    if spec.onnx is not None:
        from .onnx_runtime import require_onnxruntime

        require_onnxruntime()
        if device.type != "cpu":
            # GroupQueryAttention has no fp32 kernel on CUDA; the GPU route needs a half-precision export.
            raise ValueError(f"precision {spec.name} runs on the CPU only for now; on {device.type} use bf16 or fp16")
        return
    if device.type == "cpu" and spec.name == "fp16":
        raise ValueError("precision fp16 needs a CUDA device (CPUs have no fast fp16 matmul); use bf16 or int8")
    if device.type != "cpu" and spec.int4:
        raise ValueError(f"precision {spec.name} runs a CPU kernel; on {device.type} use int8, bf16 or fp16")
    if device.type != "cpu" and spec.int8 in ("dynamic", "static"):
        raise ValueError(f"precision {spec.name} uses fbgemm CPU kernels; on {device.type} use int8, bf16 or fp16")
    if spec.int8 in ("dynamic", "static") and "fbgemm" not in torch.backends.quantized.supported_engines:
        raise ValueError(f"precision {spec.name} needs torch's fbgemm backend, which this torch build lacks")
    if device.type == "cuda" and spec.trunk_dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ValueError(f"precision {spec.name} needs bf16, which this GPU does not support; use fp16")


# --------------------------------------------------------------------------------------------------
# int8 weights


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: w ~= q * scale[:, None], q in [-127, 127]."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def _has_kernel(op: str, device: torch.device) -> bool:
    key = "CUDA" if device.type == "cuda" else device.type.upper()
    return torch._C._dispatch_has_kernel_for_dispatch_key(op, key)


class Int8Linear(nn.Module):
    """Weight-only int8 (per-channel scales); activations stay in ``compute_dtype`` (bf16/fp16)."""

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_weight(linear.weight)
        self.register_buffer("weight", q, persistent=False)
        self.register_buffer("scale", scale.to(compute_dtype), persistent=False)
        self.bias = linear.bias
        self.compute_dtype = compute_dtype
        # Fused int8 GEMM where torch has one for this device; else dequantise into the matmul.
        self._fused = compute_dtype != torch.float16 and _has_kernel("aten::_weight_int8pack_mm", q.device)

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if self._fused:
            return torch.ops.aten._weight_int8pack_mm(rows, self.weight, self.scale)
        return F.linear(rows, self.weight.to(self.compute_dtype)) * self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = on_rows(x, self._matmul, self.compute_dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype)


def _fbgemm_pack(linear: nn.Linear) -> torch.Tensor:
    q, scale = quantize_weight(linear.weight)
    with warnings.catch_warnings():  # torch marks quantized tensors deprecated; fbgemm's packing needs one
        warnings.simplefilter("ignore")
        qw = torch._make_per_channel_quantized_tensor(q, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0)
        bias = linear.bias.detach().float() if linear.bias is not None else None
        return torch.ops.quantized.linear_prepack(qw, bias)


class DynamicInt8Linear(nn.Module):
    """fbgemm int8 x int8: activations quantised with one scale per call (min/max of the whole input).

    ``reduce_range``: activations use 7 bits, which avoids the int16 saturation of AVX2's u8*s8 pair
    sums (the same default torch.ao uses on x86)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = _fbgemm_pack(linear)

    @torch.compiler.disable  # fbgemm's packed weights are opaque to dynamo: a graph break, run eagerly
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return on_rows(x, lambda rows: torch.ops.quantized.linear_dynamic(rows, self.packed, True), torch.float32)


class StaticInt8Linear(nn.Module):
    """fbgemm int8 x int8 with a fixed activation scale per layer (from ``calibrate``).

    The activation is quantised as uint8 with zero point 64 and 7-bit range (see ``DynamicInt8Linear``);
    values beyond the calibrated range saturate. One fixed scale makes every row's result independent
    of the other rows (batch invariance)."""

    ZERO_POINT = 64

    def __init__(self, linear: nn.Linear, absmax: float) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = _fbgemm_pack(linear)
        self.x_scale = max(float(absmax), 1e-6) / 63.0

    @torch.compiler.disable  # (see DynamicInt8Linear.forward)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32
        return on_rows(x, lambda rows: op(rows, self.x_scale, self.ZERO_POINT, self.packed), torch.float32)


# --------------------------------------------------------------------------------------------------
# 4-bit weights

INT4_BLOCK = 128
"""Inputs per scale: at 1-8 rows block 128 with bf16 scales is the kernel's fastest (fewer scale bytes to read;
``bench kernels``: cpp-int4-b128-bf16s), at the quality ``eval`` reports for the int4 mode."""


class Int4GemvLinear(nn.Module):
    """4-bit weights (symmetric, blocks of ``INT4_BLOCK``, bf16 scales) on ``kernels.int4_gemv`` at every width."""

    def __init__(self, linear: nn.Linear, block: int = INT4_BLOCK, scale_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Narrower inputs (the tiny test model's 64) take the largest block that divides them.
        fits = [b for b in int4_gemv.BLOCKS if b <= block and linear.in_features % b == 0]
        if not fits:
            raise ValueError(f"int4 needs input features in multiples of 32; got {linear.in_features}")
        self.packed = int4_gemv.pack(linear.weight, fits[-1], scale_dtype)
        self.bias = linear.bias

    @torch.compiler.disable  # a custom C++ op on an opaque packed stream: run eagerly
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = int4_gemv.linear(x, self.packed)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)


# --------------------------------------------------------------------------------------------------
# Module swap


def record_absmax(module: nn.Module, run: Callable[[], None]) -> dict[str, float]:
    """Largest |input| seen by each ``nn.Linear`` under ``module`` while ``run()`` executes."""
    seen: dict[str, float] = {}
    hooks = []
    for name, m in module.named_modules():
        if isinstance(m, nn.Linear):

            def hook(_m, inputs, _out, name=name):
                v = float(inputs[0].detach().abs().amax())
                seen[name] = max(seen.get(name, 0.0), v)

            hooks.append(m.register_forward_hook(hook))
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return seen


def apply_precision_(
    gpt: nn.Module, spec: PrecisionSpec, device: torch.device, absmax: dict[str, float] | None = None
) -> None:
    """Turn an fp32 trunk into ``spec`` in place (int8 from the fp32 weights, then the rest cast)."""
    check_supported(spec, device)
    if spec.int8 == "weight":
        swap_linears_(gpt, lambda _n, lin: Int8Linear(lin, spec.trunk_dtype))
    elif spec.int8 == "dynamic":
        swap_linears_(gpt, lambda _n, lin: DynamicInt8Linear(lin))
    elif spec.int8 == "static":
        if absmax is None:
            raise ValueError("int8-static needs calibration (activation ranges per layer)")
        missing = [n for n, m in gpt.named_modules() if isinstance(m, nn.Linear) and n not in absmax]
        if missing:
            raise ValueError(f"calibration saw no input for {len(missing)} layer(s), e.g. {missing[0]}")
        swap_linears_(gpt, lambda n, lin: StaticInt8Linear(lin, absmax[n]))
    if spec.int4:
        swap_linears_(gpt, lambda _n, lin: Int4GemvLinear(lin))
    # What is left in float: norm weights (and, without int8, the projections). Buffers (the rotary
    # frequencies) stay fp32.
    for p in gpt.parameters():
        p.data = p.data.to(spec.trunk_dtype)
