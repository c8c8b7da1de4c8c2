"""Kokoro's graph modes: the decoder's convolutions (nearly all of a request's time) as one OpenVINO graph on the CPU.

What runs where, per utterance (``KokoroModel.synthesize``, a row at a time):

- torch, fp32, as in every mode: the text side (ALBERT, the LSTMs, durations, F0 and energy), so durations, word
  times and the F0 curve are fp32's exactly; then the sine source and its STFT (``Generator.harmonics``: the
  utterance's own noise generator draws there, so a seed repeats), and at the end the inverse STFT.
- OpenVINO: the rest (``RowGraph``: the decoder's 1024-channel blocks and the generator's upsampling and
  multi-receptive-field blocks), exported once at load (ONNX, in memory), its frame axis dynamic.

Modes (``--audio-dtype``, plus ``--precision int8``; ``family.KokoroFamily.load`` resolves them):

``ov-fp32``  the graph computing in f32.
``ov-bf16``  the graph computing in bf16 (AVX-512 BF16 / AMX; OpenVINO keeps its norms' statistics in f32).
``int8``     the graph's convolutions quantized to int8, weights and activations (nncf's post-training
             quantization, calibrated at load on utterances the model makes from random phonemes: no data set
             needed), the transposed (upsampling) convolutions left out of it; the rest in bf16 where the CPU has
             it, else f32.

The snake activation's sine goes into the graph as a polynomial (``sin_squared``): OpenVINO's CPU plugin runs
``Sin`` as a scalar reference loop, which made the snakes as slow as every convolution together.
"""

from __future__ import annotations

import io
import math
import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from ...kernels import openvino
from .blocks import AdaINResBlock1
from .layers import Lengths
from .model import KokoroModel, RowSpectrum, Utterance

if TYPE_CHECKING:
    import numpy as np


GRAPH_DTYPES = ("ov-fp32", "ov-bf16")
"""The ``--audio-dtype`` names that run the decoder as an OpenVINO graph (the names ChatTTS's audio graph takes)."""
INPUTS = ("asr", "f0", "energy", "style", "har")


# sin(x)^2 by Cody-Waite reduction to [-pi/2, pi/2] (pi split so that k * _PI_HI is exact in float32) and an odd
# Taylor polynomial of degree 11 there: within 4e-7 of float64's sin(x)^2 for |x| <= 300 (the square drops the
# sign that (-1)^k would restore).
_PI_HI = 3.140625
_PI_LO = math.pi - _PI_HI
_SIN_COEFFS = (-1 / 6, 1 / 120, -1 / 5040, 1 / 362880, -1 / 39916800)


def sin_squared(x: torch.Tensor) -> torch.Tensor:
    """sin(x)^2 from multiplies, adds and a round: ops OpenVINO's CPU plugin compiles (its ``Sin`` it does not)."""
    k = torch.round(x * (1 / math.pi))
    r = (x - k * _PI_HI) - k * _PI_LO
    r2 = r * r
    poly = _SIN_COEFFS[-1]
    for c in reversed(_SIN_COEFFS[:-1]):
        poly = c + r2 * poly
    s = r * (1 + r2 * poly)
    return s * s


def graph_norm_snake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, gamma: torch.Tensor,
                     beta: torch.Tensor, alpha: torch.Tensor, dtype: torch.dtype, eps: float = 1e-5) -> torch.Tensor:
    """``blocks.norm_snake`` for the graph: the same AdaIN and snake, the sine squared by ``sin_squared``."""
    mean = x.mean(dim=2, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=2, keepdim=True)
    h = (x - mean) * torch.rsqrt(var + eps) * weight[None, :, None] + bias[None, :, None]
    h = (1 + gamma) * h + beta
    return h + (1 / alpha) * sin_squared(alpha * h)


class _Unpadded(Lengths):
    """The lengths of one unpadded row, whatever its length: nothing to mask, no Python int of the shape kept
    (a traced graph must not bake one in)."""

    def __init__(self) -> None:
        self.lengths, self.total, self.ragged, self._mask = torch.zeros(0), 0, False, None

    def scaled(self, factor: int, extra: int = 0) -> Lengths:
        return self


class RowGraph(nn.Module):
    """The decoder of one unpadded row after its source: ``(asr [1, C, F], f0 [1, 2F], energy [1, 2F], style
    [1, style_dim], har [1, n_fft + 2, L]) -> spectrum [1, n_fft + 2, L]`` (``Decoder.spectra``): a graph to
    export."""

    def __init__(self, decoder: nn.Module) -> None:
        super().__init__()
        self.decoder = decoder

    def forward(self, asr: torch.Tensor, f0: torch.Tensor, energy: torch.Tensor, style: torch.Tensor,
                har: torch.Tensor) -> torch.Tensor:
        return self.decoder.spectra(asr, f0, energy, style, _Unpadded(), har)


@contextmanager
def _graph_snakes(decoder: nn.Module) -> Iterator[None]:
    """The generator's blocks on ``graph_norm_snake`` for the duration (an export), then as they were."""
    blocks = [m for m in decoder.modules() if isinstance(m, AdaINResBlock1)]
    before = [b.__dict__.get("fused") for b in blocks]
    for b in blocks:
        b.fused = graph_norm_snake
    try:
        yield
    finally:
        for b, fused in zip(blocks, before, strict=True):
            if fused is None:
                del b.fused
            else:
                b.fused = fused


def export_onnx(model: KokoroModel, example: Sequence[torch.Tensor]) -> bytes:
    """``RowGraph`` of ``model``'s (fp32) decoder as an ONNX graph in memory, its time axes dynamic; ``example``:
    one row's inputs (``row_inputs``) to trace with."""
    graph = RowGraph(model.decoder).eval()
    out = io.BytesIO()
    # The tracer warns that Python checks on shapes are constants in the graph (they are: a row alone has no
    # padding), and that the TorchScript exporter is deprecated (the dynamo one needs onnxscript, not installed).
    with torch.no_grad(), warnings.catch_warnings(), _graph_snakes(model.decoder):
        warnings.simplefilter("ignore")
        torch.onnx.export(graph, tuple(example), out, input_names=list(INPUTS), output_names=["spectrum"],
                          dynamic_axes={"asr": {2: "frames"}, "f0": {1: "steps"}, "energy": {1: "steps"},
                                        "har": {2: "bins"}, "spectrum": {2: "bins"}},
                          opset_version=17, dynamo=False)
    return out.getvalue()


def row_inputs(model: KokoroModel, input_ids: Sequence[int], style: torch.Tensor,
               generator: torch.Generator | None) -> tuple[torch.Tensor, ...]:
    """One utterance's ``RowGraph`` inputs, computed by torch (the text side, then the source)."""
    side = model._text_side([Utterance(input_ids, style, 1.0, generator)])
    har = model.decoder.generator.harmonics(side.f0, side.frames.scaled(2), [generator])  # F0 at 2x frames
    return side.asr, side.f0, side.energy, side.decoder_style, har


def calibration(model: KokoroModel, style: torch.Tensor, lengths: Sequence[int] = (24, 64)) -> list[dict]:
    """``RowGraph`` inputs for int8's calibration: utterances of random phonemes (fixed seed, so a checkpoint
    quantizes the same way every load) in ``style``; nothing but the checkpoint is needed."""
    rng = torch.Generator().manual_seed(0)
    feeds = []
    with torch.inference_mode():
        for n in lengths:
            ids = [0, *torch.randint(1, model.config.n_token, (n,), generator=rng).tolist(), 0]
            example = row_inputs(model, ids, style, torch.Generator().manual_seed(n))
            feeds.append({name: t.cpu().numpy() for name, t in zip(INPUTS, example, strict=True)})
    return feeds


def attach(model: KokoroModel, audio_dtype: str, int8: bool, threads: int, style: torch.Tensor) -> None:
    """Put ``model`` (fp32, on the CPU) on the graph: ``audio_dtype`` one of ``GRAPH_DTYPES`` (the precision of what
    int8 leaves out, under ``int8``); ``threads`` OpenVINO's; ``style`` a voice row for int8's calibration.
    ValueError where openvino (or, for int8, nncf) is not installed."""
    if audio_dtype not in GRAPH_DTYPES:
        raise ValueError(f"audio_dtype {audio_dtype} is not an OpenVINO graph dtype ({', '.join(GRAPH_DTYPES)})")
    try:
        import openvino as ov
    except ImportError:
        mode = "--precision int8" if int8 else f"--audio-dtype {audio_dtype}"
        raise ValueError(f"{mode} runs Kokoro's decoder through OpenVINO: pip install 'chattts-serve[openvino]'") \
            from None
    with torch.inference_mode():
        example = row_inputs(model, [0, 1, 2, 3, 0], style, torch.Generator().manual_seed(0))
    core = ov.Core()
    graph = core.read_model(export_onnx(model, example), b"")
    if int8:
        graph = quantize(graph, calibration(model, style))
    precision = "f32" if audio_dtype == "ov-fp32" else "bf16"
    model.row_spectrum = session(graph, core, precision, threads)


def quantize(graph, feeds: list[dict]):
    """``graph``'s convolutions in int8 (nncf's post-training quantization on ``feeds``), its transposed convolutions
    left in float: quantized, OpenVINO ran them on a reference f32 kernel several times slower."""
    try:
        import nncf
    except ImportError:
        raise ValueError("--precision int8 quantizes Kokoro's decoder with nncf: pip install "
                         "'chattts-serve[openvino]'") from None
    with openvino.quiet_nncf():
        return nncf.quantize(graph, nncf.Dataset(feeds), subset_size=len(feeds), fast_bias_correction=True,
                             ignored_scope=nncf.IgnoredScope(types=["ConvolutionBackpropData"]))


def session(graph, core, precision: str, threads: int) -> RowSpectrum:
    """``graph`` compiled by OpenVINO's CPU plugin computing in ``precision``; callable from any thread (an infer
    request serves one call at a time: one per calling thread). A caller that runs torch on fewer threads than
    ``threads`` (a ``rows.RowPool`` worker: one row per core) gets a compilation with one stream per thread, so
    rows run side by side; any other, one stream on all ``threads`` (the lowest latency for one row)."""
    latency = openvino.compile_model(graph, {"INFERENCE_PRECISION_HINT": precision, "INFERENCE_NUM_THREADS": threads,
                                             "PERFORMANCE_HINT": "LATENCY"}, core)
    parallel = latency if threads < 2 else openvino.compile_model(
        graph, {"INFERENCE_PRECISION_HINT": precision, "INFERENCE_NUM_THREADS": threads, "NUM_STREAMS": threads}, core)
    local = threading.local()

    def run(*inputs: torch.Tensor) -> torch.Tensor:
        compiled = latency if torch.get_num_threads() >= threads else parallel
        requests = local.__dict__.setdefault("requests", {})
        request = requests.get(id(compiled))
        if request is None:
            request = requests[id(compiled)] = compiled.create_infer_request()
        feeds: dict[str, np.ndarray] = {
            name: t.detach().float().cpu().contiguous().numpy() for name, t in zip(INPUTS, inputs, strict=True)
        }
        return torch.from_numpy(request.infer(feeds)[0].copy())

    return run
