"""The precision modes' names (``kernels.quant`` implements them), apart from torch so that the CLI and the
configs can list them."""

from __future__ import annotations

# ``ort-*``: the trunk runs in ONNX Runtime (``models.chattts.onnx_export``), weights fp32 / int8 / 4-bit, or
# (ort-auto) 4-bit or int8 by the rows of each call (``models.chattts.onnx_auto``). ``int4``: the torch trunk on the
# hand-written 4-bit GEMV (``kernels.int4_gemv``).
PRECISIONS: tuple[str, ...] = (
    "fp32",
    "bf16",
    "fp16",
    "int8",
    "int8-dynamic",
    "int8-static",
    "int4",
    "ort-fp32",
    "ort-int8",
    "ort-int4",
    "ort-int4-b128",
    "ort-auto",
)
