"""Quantising an exported trunk's MatMul weights with ONNX Runtime's quantizers (the graph is
``models.chattts.onnx_graph``'s; nothing else changes).

``int8`` is ``quantize_dynamic`` (QInt8 weights, per output channel, 7 bits on x86 CPUs without VNNI:
see ``int8_reduce_range``; uint8 activations quantised per call), ``int4`` is ``MatMulNBits`` (4-bit,
block 32, symmetric, ``accuracy_level=4``: int8 activations per block of 32 inside each row).
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..cpu import CpuInfo, probe
from .onnx_runtime import MODEL_FILE, WEIGHT_KINDS, save_model

INT4_BLOCK_SIZE = 32
INT4_BLOCKS = {"int4": INT4_BLOCK_SIZE, "int4-b128": 128}
"""Block size of each 4-bit weight kind. Block 128 is 1.2-1.5x faster than 32 at 1-8 rows on a Zen 4
(one thread; BENCHMARKS.md, issue 33) for coarser scales (1.2x block 32's error on random weights)."""
INT4_ACCURACY_LEVEL = 4
"""int8 activations: 1.6x faster than fp32 activations (issue 12)."""


def int8_reduce_range(cpu: CpuInfo | None = None) -> bool:
    """Whether int8 weights should keep to 7 bits on this CPU (default: ``cpu.probe()``). ORT's x86
    u8 x s8 kernel without VNNI (AVX2's vpmaddubsw) adds pairs of products into int16, which full-range
    weights can overflow (2 x 255 x 127 > 32767); 7-bit weights cannot. VNNI (AVX-512 or AVX) and Arm's
    dot products accumulate in int32: full 8 bits there. Unknown CPUs get the safe choice."""
    cpu = cpu or probe()
    if cpu.arm:
        return False
    return not cpu.vnni


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


def quantize(
    src: Path,
    dst: Path,
    weights: str,
    reduce_range: bool,
    block_size: int | None = None,
    accuracy_level: int = INT4_ACCURACY_LEVEL,
) -> None:
    """Quantize ``src``'s MatMul weights into ``dst`` (both directories holding ``model.onnx``).
    ``block_size`` and ``accuracy_level``: 4-bit kinds only (``bench kernels`` compares others); the
    block size defaults to the kind's (``INT4_BLOCKS``)."""
    # The quantizers log every node at INFO, and quantize_dynamic advises pre-processing (for CNNs).
    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    root = logging.getLogger()
    advice = _DropMessage("Please consider to run pre-processing")
    root.addFilter(advice)
    try:
        block = block_size or INT4_BLOCKS.get(weights, INT4_BLOCK_SIZE)
        _run_quantizer(src, dst, weights, reduce_range, block, accuracy_level)
    finally:
        root.removeFilter(advice)


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def _run_quantizer(
    src: Path, dst: Path, weights: str, reduce_range: bool, block_size: int, accuracy_level: int
) -> None:
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
        save_model(onnx.load(str(quantized)), dst)
    elif weights in INT4_BLOCKS:
        quant = _nbits_quantizer()(
            onnx.load(str(src / MODEL_FILE)),
            bits=4,
            block_size=block_size,
            is_symmetric=True,
            accuracy_level=accuracy_level,
        )
        quant.process()
        save_model(quant.model.model, dst)
    else:
        raise ValueError(f"unknown weight kind {weights!r}; expected one of {', '.join(WEIGHT_KINDS)}")
