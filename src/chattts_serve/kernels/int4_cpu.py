"""Weight-only 4-bit linear layers on torch's own CPU kernel (``aten._weight_int4pack_mm_for_cpu``, the
kernel torchao's CPU int4 layout calls; no torchao needed).

Weights are quantised symmetrically in groups of ``group`` inputs per output channel: ``w ~= (q - 8) *
scale`` with q in [0, 15] (what the kernel's packed format holds: the zero point is 8, the "zeros" it
takes are an offset added after scaling, 0 here). The activations stay in float (fp32 or bf16), so every
row is computed alone: the result of a row does not depend on the other rows of the call (batch
invariant), unlike kernels that quantise the activations per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .linear import on_rows


@dataclass(frozen=True, slots=True)
class Int4Weight:
    packed: torch.Tensor
    """uint8, the kernel's layout ([out, in / 2])."""
    scale_zeros: torch.Tensor
    """[in / group, out, 2] in the activation dtype: (scale, 0) per group and output channel."""
    group: int
    dtype: torch.dtype
    """Activation dtype the kernel runs in (fp32 or bf16)."""
    out_features: int
    """The weight's outputs; the packed weight has zero rows up to a multiple of 16 (the kernel's tile)."""

    @property
    def nbytes(self) -> int:
        return (
            self.packed.numel() * self.packed.element_size()
            + self.scale_zeros.numel() * self.scale_zeros.element_size()
        )


def available() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::_weight_int4pack_mm_for_cpu", "CPU")


def quantize(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-group 4-bit: (q [out, in] int32 in [0, 15], scale [out, in / group] fp32) with
    ``w ~= (q - 8) * scale``."""
    out, inp = w.shape
    if inp % group:
        raise ValueError(f"input features {inp} are not a multiple of the group size {group}")
    wg = w.detach().float().reshape(out, inp // group, group)
    scale = wg.abs().amax(-1).clamp_min(1e-12) / 7.0
    q = torch.round(wg / scale[..., None]).clamp_(-8, 7).add_(8).to(torch.int32)
    return q.reshape(out, inp), scale


def pack_int4(w: torch.Tensor, group: int = 32, dtype: torch.dtype = torch.float32) -> Int4Weight:
    """Quantise an fp32 [out, in] weight and pack it for the kernel."""
    out = w.shape[0]
    pad = -out % 16
    if pad:  # zero rows: all codes 8, i.e. 0; their outputs are sliced off
        w = torch.cat([w.detach().float(), w.new_zeros(pad, w.shape[1])])
    q, scale = quantize(w, group)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.stack([scale.t(), torch.zeros_like(scale.t())], -1).to(dtype).contiguous()
    return Int4Weight(packed, sz, group, dtype, out)


def dequantize(w: Int4Weight, q: torch.Tensor) -> torch.Tensor:
    """The float64 weight the kernel multiplies by, from the codes ``q`` it was packed from."""
    scale = w.scale_zeros[..., 0].t().double()[: q.shape[0]]  # [out, in / group], as the kernel reads it
    out, inp = q.shape
    return ((q.double() - 8).reshape(out, inp // w.group, w.group) * scale[..., None]).reshape(out, inp)


def int4_linear(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """x [..., in] (any float dtype) @ the weight -> [..., out] in x's dtype."""
    mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    y = on_rows(x, lambda rows: mm(rows, w.packed, w.group, w.scale_zeros), w.dtype)
    if y.shape[-1] != w.out_features:
        y = y[..., : w.out_features]
    return y.to(x.dtype)
