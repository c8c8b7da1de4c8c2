"""Kokoro's graph modes (``models.kokoro.kernels``): durations and curves exact in every mode, the waveform within
each mode's measured bound of fp32's, every row the same alone and in a batch, the engine serving a mode, and clear
refusals (a pair of flags Kokoro cannot run, OpenVINO or nncf not installed)."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from chattts_serve import SamplingParams
from chattts_serve.bench.stats import snr_db
from chattts_serve.engine.config import EngineConfig
from chattts_serve.engine.engine import Engine
from chattts_serve.models.kokoro import kernels
from chattts_serve.models.kokoro.checkpoint import load
from chattts_serve.models.kokoro.family import _audio_dtype
from chattts_serve.models.kokoro.voices import load_voice, style_for

from .test_model import _make, _utterances

MIN_SNR_DB = {"ov-fp32": 90.0, "ov-bf16": 30.0, "int8": 15.0}
"""Each mode's floor against fp32's waveform on the tiny checkpoint (8 utterances of 3-19 phonemes). Measured there,
the lowest of them: ov-fp32 121 dB, ov-bf16 38 dB, int8 21 dB; on the full-size checkpoint see docs/kokoro.md."""


def _moded(root, mode: str):
    model = load(root)
    style = style_for(load_voice(root, "af_heart"), 40)
    kernels.attach(model, "ov-bf16" if mode == "int8" else mode, mode == "int8", 1, style)
    return model


@pytest.fixture(
    scope="module",
    params=[pytest.param("ov-fp32", marks=pytest.mark.slow), "ov-bf16", pytest.param("int8", marks=pytest.mark.slow)],
)
def mode(request, kokoro_tiny):
    pytest.importorskip("openvino")
    if request.param == "int8":
        pytest.importorskip("nncf")
    return request.param, _moded(kokoro_tiny, request.param)


def test_sin_squared_is_the_sines_square_without_a_sine():
    x = torch.linspace(-300, 300, 200_001)
    exact = torch.sin(x.double()) ** 2
    assert (kernels.sin_squared(x).double() - exact).abs().max().item() <= 1e-6


def test_durations_and_curves_exact_and_the_waveform_within_the_modes_bound(mode, kokoro_model, kokoro_tiny):
    name, model = mode
    utts = _utterances(kokoro_tiny, 8, seed0=300)
    for u in utts:
        [ref] = kokoro_model.synthesize([_make(u)])
        [got] = model.synthesize([_make(u)])
        assert torch.equal(got.durations, ref.durations)
        assert torch.equal(got.f0, ref.f0) and torch.equal(got.energy, ref.energy)
        assert got.audio.shape == ref.audio.shape
        assert snr_db(ref.audio, got.audio) >= MIN_SNR_DB[name]


def test_every_row_equals_itself_alone(mode, kokoro_tiny):
    """A graph mode runs each row alone through the graph, so a batch changes nothing: bit for bit."""
    _, model = mode
    utts = _utterances(kokoro_tiny, 5, seed0=500)
    alone = [model.synthesize([_make(u)])[0] for u in utts]
    together = model.synthesize([_make(u) for u in utts])
    for a, b in zip(alone, together, strict=True):
        assert torch.equal(a.durations, b.durations) and torch.equal(a.audio, b.audio)


def test_the_engine_serves_a_graph_mode(kokoro_tiny):
    pytest.importorskip("openvino")
    text, params = "你好，世界。", SamplingParams(speaker="zf_xiaobei", seed=3)
    [a] = Engine.from_pretrained(kokoro_tiny, config=EngineConfig()).synthesize(text, params)
    graph = Engine.from_pretrained(kokoro_tiny, config=EngineConfig(audio_dtype="ov-fp32"))
    assert graph.family_model.config.audio_dtype == "ov-fp32"
    assert graph.family_model.model.row_spectrum is not None
    [b] = graph.synthesize(text, params)
    assert a.audio.shape == b.audio.shape
    assert snr_db(torch.from_numpy(a.audio), torch.from_numpy(b.audio)) >= MIN_SNR_DB["ov-fp32"]


@pytest.mark.slow
def test_the_engine_serves_int8(kokoro_tiny):
    pytest.importorskip("openvino")
    pytest.importorskip("nncf")
    engine = Engine.from_pretrained(kokoro_tiny, config=EngineConfig(precision="int8"))
    assert engine.family_model.config.audio_dtype in kernels.GRAPH_DTYPES
    [speech] = engine.synthesize("你好，世界。", SamplingParams(speaker="zf_xiaobei", seed=3))
    assert len(speech.audio) > 0 and math.isfinite(float(abs(speech.audio).max()))


class _Config:
    def __init__(self, audio_dtype: str = "auto", precision: str = "fp32") -> None:
        self.audio_dtype, self.precision = audio_dtype, precision


@pytest.mark.parametrize(("audio_dtype", "precision", "device", "message"), [
    ("ort-fp32", "fp32", "cpu", "--audio-dtype ort-fp32 is ChatTTS's audio stage"),
    ("ov-int8", "fp32", "cpu", "--audio-dtype ov-int8 is ChatTTS's audio stage only"),
    ("ov-bf16", "fp32", "cuda", "ov-bf16 runs on the CPU only"),
    ("fp32", "int8", "cpu", "--precision int8 quantizes Kokoro's OpenVINO graph; --audio-dtype fp32 is not one"),
    ("auto", "int8", "cuda", "--precision int8 runs Kokoro's decoder on the CPU"),
    ("auto", "int8-dynamic", "cpu", "--precision int8-dynamic is ChatTTS's"),
])
def test_a_pair_of_flags_kokoro_cannot_run_is_refused_by_name(audio_dtype, precision, device, message):
    with pytest.raises(ValueError, match=message):
        _audio_dtype(_Config(audio_dtype, precision), device)


def test_the_modes_resolve_once(monkeypatch):
    from chattts_serve import cpu

    assert _audio_dtype(_Config("ov-bf16"), "cpu") == "ov-bf16"
    assert _audio_dtype(_Config(), "cpu") == "fp32"
    for bf16, expected in ((True, "ov-bf16"), (False, "ov-fp32")):
        monkeypatch.setattr(cpu, "probe", lambda bf16=bf16: type("Info", (), {"bf16": bf16})())
        assert _audio_dtype(_Config(precision="int8"), "cpu") == expected
    assert _audio_dtype(_Config("ov-fp32", "int8"), "cpu") == "ov-fp32"


@pytest.mark.parametrize(("missing", "mode", "message"), [
    ("openvino", "ov-bf16", r"--audio-dtype ov-bf16 runs Kokoro's decoder through OpenVINO: .*\[openvino\]"),
    ("nncf", "int8", r"--precision int8 quantizes Kokoro's decoder with nncf: .*\[openvino\]"),
])
def test_a_missing_runtime_names_the_extra(kokoro_model, kokoro_tiny, monkeypatch, missing, mode, message):
    if missing == "nncf":
        pytest.importorskip("openvino")
        with pytest.raises(ValueError, match=message):
            monkeypatch.setitem(sys.modules, "nncf", None)
            kernels.quantize(object(), [])
        return
    monkeypatch.setitem(sys.modules, "openvino", None)
    with pytest.raises(ValueError, match=message):
        kernels.attach(kokoro_model, mode, False, 1, style_for(load_voice(kokoro_tiny, "af_heart"), 10))
    assert kokoro_model.row_spectrum is None


@pytest.mark.slow
def test_int8_quantizes_every_convolution_but_the_transposed_ones(kokoro_model, kokoro_tiny):
    """The mode is int8 in fact: every forward convolution's weights are int8, and the generator's (where the time
    goes) take int8 activations, a FakeQuantize (a silently skipped layer would leave the SNR bound met and the
    mode a relabelled bf16). The 1x1 shortcuts read a concatenation of quantized inputs, F0's and energy's one
    channel is left as it is."""
    ov = pytest.importorskip("openvino")
    pytest.importorskip("nncf")
    style = style_for(load_voice(kokoro_tiny, "af_heart"), 40)
    example = kernels.row_inputs(kokoro_model, [0, 1, 2, 3, 0], style, torch.Generator().manual_seed(0))
    graph = ov.Core().read_model(kernels.export_onnx(kokoro_model, example), b"")
    quantized = kernels.quantize(graph, kernels.calibration(kokoro_model, style, lengths=(8,)))
    convolutions = [op for op in quantized.get_ops() if op.get_type_name() == "Convolution"]
    assert convolutions
    generator = [op for op in convolutions if op.get_friendly_name().startswith(("/resblocks", "/noise", "/conv_post"))]
    assert len(generator) > len(convolutions) // 2
    for op in generator:
        assert op.input_value(0).get_node().get_type_name() == "FakeQuantize", op
    for op in convolutions:
        assert _weights(op.input_value(1)).get_element_type() in (ov.Type.i8, ov.Type.u8), op


def _weights(value):
    """The constant a convolution's weights come from, up through nncf's dequantization (Convert, Subtract of the
    zero point, Multiply by the scale: the stored values are each one's first input) and any Reshape."""
    node = value.get_node()
    while node.get_type_name() != "Constant":
        node = node.input_value(0).get_node()
    return node
