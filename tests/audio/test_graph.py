"""audio/graph.py: the Decoder + Vocos convolutions as one ONNX Runtime / OpenVINO graph give the torch
path's waveform (fp32: to rounding; bf16: to bf16's precision), and a bad runtime name is refused."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from chattts_serve.audio.decode import _decode_batch
from chattts_serve.audio.graph import AudioGraph
from chattts_serve.models.chattts.checkpoint import load

pytestmark = pytest.mark.timeout(300)


def _snr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    noise = float(((ref.double() - test.double()) ** 2).sum())
    return math.inf if noise == 0 else 10 * math.log10(float((ref.double() ** 2).sum()) / noise)


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load(tiny_ckpt)


@pytest.mark.parametrize(
    ("runtime", "min_db", "module"),
    [("ort-fp32", 80.0, "onnxruntime"), ("ov-fp32", 80.0, "openvino"), ("ov-bf16", 25.0, "openvino")],
)
def test_graph_gives_the_torch_waveform(model, runtime, min_db, module):
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")
    graph = AudioGraph(model, runtime, threads=1)
    h = torch.randn(3, 17, model.config.gpt.hidden_size, generator=torch.Generator().manual_seed(0))
    ref = _decode_batch(model, h, "fp32", None)
    wav = graph.decode(h)
    assert wav.shape == ref.shape == (3, 512 * 17 - 256) and wav.dtype == torch.float32
    assert _snr_db(ref, wav) > min_db
    # another length and batch through the same graph (dynamic shapes)
    h2 = h[:1, :9]
    assert _snr_db(_decode_batch(model, h2, "fp32", None), graph.decode(h2)) > min_db


def test_an_unknown_runtime_is_refused(model):
    with pytest.raises(ValueError, match="audio runtime must be one of"):
        AudioGraph(model, "tensorrt")
