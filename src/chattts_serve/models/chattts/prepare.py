"""Make a loaded fp32 model ready to run: the one place that changes the model after ``checkpoint.load``.

In order: fuse the q/k/v and gate/up projections (everywhere but the reference-exact path), calibrate
activation ranges (``int8-static`` only, on the fused fp32 model), swap in the precision's modules,
then choose the CPU matmul layout for batching (oneDNN-packed weights, or row padding). The engine's
runner only runs the result; ``ModelLayout`` tells it what was done.

The ``ort-*`` precisions instead export the fp32 trunk to ONNX (or take the export from the cache) and
open an ONNX Runtime session on it (``ModelLayout.trunk``); the torch trunk's weights are then dropped.
``ort-auto`` opens two (its int4 and int8 exports) behind one ``onnx_auto.AutoTrunk``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...kernels.linear import pack_linears_, packing_available
from ...kernels.quant import PrecisionSpec, apply_precision_, check_supported
from ...kernels.split_linear import split_linears_
from .checkpoint import LoadedModel
from .gpt import fuse_projections_, use_int4_decode_, use_int4_row_blocks_
from .onnx_auto import AutoTrunk, resolve_crossover
from .onnx_trunk import OnnxTrunk

logger = logging.getLogger(__name__)

Calibrate = Callable[[LoadedModel], dict[str, float]]
"""Runs the (fused, fp32) model on sample text and returns the largest |input| of each GPT linear."""


@dataclass(frozen=True, slots=True)
class ModelLayout:
    """How the prepared model's matmuls behave, for the runner."""

    precision: PrecisionSpec
    packed: bool = False
    """GPT projections are oneDNN-packed (batch-invariant at any row count)."""
    pad_rows_to: int = 1
    """Run fp32 matmuls on a multiple of this many rows (batch invariance where packing is missing)."""
    trunk: OnnxTrunk | AutoTrunk | None = None
    """``ort-*``: the GPT trunk runs in this ONNX Runtime session (``models.chattts.gpt`` holds no weights);
    ``ort-auto``: in one of two, by the width of each call."""


def prepare_model(
    model: LoadedModel,
    spec: PrecisionSpec,
    num_slots: int,
    *,
    compile: bool = False,
    calibrate: Calibrate | None = None,
    onnx_cache_dir: str | None = None,
    ort_auto_crossover: int = 0,
) -> ModelLayout:
    """Prepare ``model`` in place for ``num_slots`` sequences decoding together in precision ``spec``.

    With one slot in fp32 the ops are chattts's (bit-exact; its one-row matmuls split across threads with the
    same bits: ``kernels.split_linear``). With more, a request's result
    must not depend on its neighbours: the projections are packed for oneDNN (whose per-row result is
    the same at any row count), or fp32 matmuls run on a multiple of 4 rows where packing is missing.
    ``compile``: the decode step will be compiled (inductor cannot lower packed weights; it packs its own).
    ``onnx_cache_dir``: where ``ort-*`` exports are cached (default: the user cache directory).
    ``ort_auto_crossover``: ``ort-auto`` runs calls of this many rows or more in int8 (0: the CPU table).
    """
    device = model.embed.emb_text.weight.device
    check_supported(spec, device)
    if spec.onnx is not None:
        return _prepare_onnx(model, spec, num_slots, device, onnx_cache_dir, ort_auto_crossover)
    if spec.name != "fp32" or num_slots > 1:
        fuse_projections_(model.gpt)
    absmax = None
    if spec.int8 == "static":
        if calibrate is None:
            raise ValueError("int8-static needs a calibration function")
        absmax = calibrate(model)
    apply_precision_(model.gpt, spec, device, absmax)
    if spec.int4 and use_int4_decode_(model.gpt):
        logger.info("int4: the decode step's layers run as one C++ call")
        use_int4_row_blocks_(model.gpt)
    packed, pad_rows_to = False, 1
    dtype = model.gpt.norm.weight.dtype
    if spec.name == "fp32" and num_slots == 1 and device.type == "cpu" and not compile:
        # The reference's F.linear, its one-row calls on every core with the same bits (kernels.split_linear;
        # an op inductor cannot trace, so not under compile).
        logger.info("fp32: %d one-row matmuls split across threads", split_linears_(model.gpt.layers))
    if num_slots > 1 and device.type == "cpu":
        # int8 modes have swapped the projections already: only float linears pack, then the heads.
        if packing_available(device, dtype) and not compile:
            pack_linears_(model.gpt)
            packed = True
        elif dtype == torch.float32:
            pad_rows_to = 4
    # The int4 mode's code heads in bf16 at any slot count (embed.py: half the step's other bytes, at a
    # quality cost eval does not resolve); batch-invariant as the fp32 packing. Packed once either way.
    if spec.int4 and packing_available(device, torch.bfloat16):
        model.embed.pack_heads(code_dtype=torch.bfloat16)
    elif num_slots > 1 and device.type == "cpu" and packing_available(device, torch.float32):
        model.embed.pack_heads()
    layout = ModelLayout(spec, packed, pad_rows_to)
    logger.info("model prepared: %s", layout)
    return layout


def _prepare_onnx(
    model: LoadedModel,
    spec: PrecisionSpec,
    num_slots: int,
    device: torch.device,
    cache_dir: str | None,
    crossover: int,
) -> ModelLayout:
    from .onnx_export import cached_export

    def session(weights: str) -> OnnxTrunk:
        return OnnxTrunk(cached_export(model, weights, cache_dir), model.config.gpt, weights, device)

    trunk: OnnxTrunk | AutoTrunk
    if spec.onnx == "auto":
        rows, source = resolve_crossover(crossover)
        trunk = AutoTrunk(session("int4"), session("int8"), rows)
        logger.info("ort-auto: int4 below %d rows per call, int8 from there (crossover: %s)", rows, source)
    else:
        trunk = session(spec.onnx)
    # The session holds its own copy of the weights; the torch trunk's would only cost memory (and a
    # stray call into it fails loudly on meta tensors instead of running on stale weights).
    model.gpt.to("meta")
    if num_slots > 1 and packing_available(device, torch.float32):  # as the torch modes: heads batch-invariant
        model.embed.pack_heads()
    layout = ModelLayout(spec, trunk=trunk)
    logger.info("model prepared: %s", layout)
    return layout
