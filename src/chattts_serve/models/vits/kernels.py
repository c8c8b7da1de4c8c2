"""VITS's precision modes: the flow and the HiFi-GAN decoder (nearly all of a request's time) on a faster kernel.

The text encoder and the duration predictor stay in fp32 eager torch in every mode, so a request's durations
(its length, its word times) are fp32's exactly; only the waveform moves. Modes (``--precision``, the engine's
names, ``kernels.precisions``):

``fp32``      eager torch, transformers' ``VitsModel`` bit for bit (the default).
``ort-fp32``  CPU: the flow and decoder exported to ONNX once at load and run by ONNX Runtime (its own conv
              kernels, activations fused), fp32 (``pip install 'chattts-serve[onnx]'``).
``bf16``      CPU: the same graph run by OpenVINO with bf16 inference (AVX-512 BF16 / AMX where the CPU has them;
              ``pip install -e ".[openvino]"``); CUDA: the flow and decoder's weights in bf16 on torch.
``int8``      CPU: the same graph run by OpenVINO, the flow in f32, the decoder's weights compressed to int8 (nncf's
              data-free per-channel ``INT8_ASYM``, the [openvino] extra) and its activations in f32.

A CPU mode runs a row at a time, as the CPU path always does (``VitsModel.decode_latents``): a row's audio is
the same alone or in any batch. Their cost against fp32 (SNR, durations) is measured in docs/vits.md.
"""

from __future__ import annotations

import io
import logging
import threading
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from ...kernels import openvino
from .masks import Lengths

if TYPE_CHECKING:
    import numpy as np

MODES = ("fp32", "bf16", "ort-fp32", "int8")
"""The precisions VITS takes (``EngineConfig.precision``); any other is refused by name."""

RowDecoder = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]
"""One unpadded row: prior [1, flow_size, T] (and speaker [1, S, 1] or None) -> audio float32 [T * hop]."""


class Flow(nn.Module):
    """The flow in reverse for one unpadded row (no mask: a row alone has no padding): a graph to export."""

    def __init__(self, flow: nn.Module) -> None:
        super().__init__()
        self.flow = flow

    def forward(self, prior: torch.Tensor, speaker: torch.Tensor | None = None) -> torch.Tensor:
        return self.flow.reverse(prior, torch.ones_like(prior[:, :1, :]), speaker)


class Decoder(nn.Module):
    """The HiFi-GAN decoder for one unpadded row: a graph to export."""

    def __init__(self, decoder: nn.Module) -> None:
        super().__init__()
        self.decoder = decoder

    def forward(self, latent: torch.Tensor, speaker: torch.Tensor | None = None) -> torch.Tensor:
        return self.decoder(latent, _Unpadded(), speaker)


class _Unpadded(Lengths):
    """The lengths of one unpadded row, whatever its length (traceable: no Python int of the shape is kept)."""

    def __init__(self) -> None:
        self.lengths, self.total, self.ragged, self._mask = [], 0, False, None

    def scaled(self, factor: int) -> Lengths:
        return self


def check_mode(precision: str, device: torch.device) -> None:
    """ValueError naming the precision when VITS cannot run it on ``device``."""
    if precision not in MODES:
        raise ValueError(f"the vits family runs in {', '.join(MODES)}; --precision {precision} is another family's")
    if precision == "ort-fp32" and device.type != "cpu":
        raise ValueError("--precision ort-fp32 runs VITS on the CPU (ONNX Runtime); on an accelerator use bf16")
    if precision == "int8" and device.type != "cpu":
        raise ValueError("--precision int8 runs VITS on the CPU (OpenVINO); on an accelerator use bf16")


def attach(model, precision: str, threads: int | None = None) -> None:
    """Put ``model`` (a loaded ``VitsModel``) in ``precision``: its ``row_decoder`` (CPU modes) or its flow and
    decoder's dtype (bf16 on an accelerator). ``threads``: the CPU kernels' (None: torch's)."""
    check_mode(precision, model.device)
    if precision == "fp32":
        return
    if model.device.type != "cpu":  # bf16 on an accelerator: torch's own kernels, padded batches
        torch_bf16(model)
        return
    threads = threads or torch.get_num_threads()
    flow, decoder = export_onnx(model, Flow(model.flow)), export_onnx(model, Decoder(model.decoder))
    if precision == "ort-fp32":
        model.row_decoder = _chained(ort_session(flow, threads), ort_session(decoder, threads))
    elif precision == "int8":  # f32 activations: bf16 ones ran at bf16's speed for 1 dB less (docs/vits.md)
        decoder_session = openvino_session(decoder, threads, "f32", compress=True)
        model.row_decoder = _chained(openvino_session(flow, threads, "f32"), decoder_session)
    else:  # the flow in fp32 (bf16 there costs 8 dB of SNR for a few % of the time), the decoder in bf16
        model.row_decoder = _chained(openvino_session(flow, threads, "f32"), openvino_session(decoder, threads, "bf16"))


def torch_bf16(model) -> None:
    """The flow and decoder's weights in bf16 on torch (the text side stays fp32): what an accelerator runs, padded
    batches and masks included (``VitsModel.decode_dtype``); on a CPU it is slower than fp32 (1.2x at best) and
    only tests take it."""
    model.flow.to(torch.bfloat16)
    model.decoder.to(torch.bfloat16)


Session = Callable[[dict], "np.ndarray"]
"""One exported graph: its inputs by name (numpy) -> its output."""


def _chained(flow: Session, decoder: Session) -> RowDecoder:
    def run(prior: torch.Tensor, speaker: torch.Tensor | None) -> torch.Tensor:
        extra = {} if speaker is None else {"speaker": speaker.detach().float().cpu().contiguous().numpy()}
        latent = flow({"x": prior.detach().float().cpu().contiguous().numpy(), **extra})
        return torch.from_numpy(decoder({"x": latent, **extra})[0].copy())

    return run


def export_onnx(model, module: nn.Module) -> bytes:
    """``module`` (``Flow`` or ``Decoder`` of ``model``) as an ONNX graph, its time axis dynamic, in memory:
    input ``x`` [1, flow_size, T] (and ``speaker`` [1, S, 1] on a multi-speaker checkpoint), output ``y``."""
    x = torch.zeros(1, model.config.flow_size, 16)
    args: tuple = (x,)
    names = ["x"]
    if model.config.num_speakers > 1:
        args = (x, torch.zeros(1, model.config.speaker_embedding_size, 1))
        names.append("speaker")
    out = io.BytesIO()
    # The tracer warns that the masks' Python checks are constants in the graph (they are: a row alone has no
    # padding), and that the TorchScript exporter is deprecated (the dynamo one needs onnxscript, not installed).
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), args, out, input_names=names, output_names=["y"],
                          dynamic_axes={"x": {2: "frames"}, "y": {-1: "length"}}, opset_version=17, dynamo=False)
    return out.getvalue()


def ort_session(graph: bytes, threads: int) -> Session:
    try:
        import onnxruntime as ort
    except ImportError:
        raise ValueError("--precision ort-fp32 needs ONNX Runtime: pip install 'chattts-serve[onnx]'") from None
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
    return lambda feeds: session.run(None, feeds)[0]


def openvino_session(graph: bytes, threads: int, precision: str, compress: bool = False) -> Session:
    """``graph`` compiled by OpenVINO's CPU plugin computing in ``precision`` (``f32``/``bf16``); ``compress``: its
    weights compressed to int8 first (``int8_weights``)."""
    try:
        import openvino as ov
    except ImportError:
        mode = "int8" if compress else "bf16"
        raise ValueError(f"--precision {mode} runs VITS on the CPU through OpenVINO: the [openvino] extra") from None
    core = ov.Core()
    model = core.read_model(graph, b"")
    if compress:
        model = int8_weights(model)
    settings = {"INFERENCE_PRECISION_HINT": precision, "INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY"}
    compiled = openvino.compile_model(model, settings, core)
    local = threading.local()  # an infer request serves one call at a time: one per calling thread

    def run(feeds: dict):
        request = getattr(local, "request", None)
        if request is None:
            request = local.request = compiled.create_infer_request()
        return request.infer(feeds)[0]

    return run


def int8_weights(model):
    """An OpenVINO model with its convolutions' weights compressed to int8 by nncf (data-free: per output channel,
    asymmetric; no calibration set, so the mode needs nothing but the checkpoint)."""
    try:
        import nncf
        from nncf.common.logging import nncf_logger
    except ImportError:
        raise ValueError("--precision int8 compresses VITS's decoder with nncf: the [openvino] extra") from None
    level = nncf_logger.level
    nncf_logger.setLevel(logging.WARNING)  # its statistics table (INFO) is noise in a server's log
    try:
        return nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)
    finally:
        nncf_logger.setLevel(level)
