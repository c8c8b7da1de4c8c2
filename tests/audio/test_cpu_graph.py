"""audio/cpu_graph.py: the Decoder + Vocos convolutions as one ONNX Runtime / OpenVINO graph give the torch
path's waveform (fp32: to rounding; bf16: to bf16's precision), and a bad runtime name is refused."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from chattts_serve.audio.cpu_graph import AudioGraph, graph_for
from chattts_serve.audio.decode import _decode_batch, decode_windows
from chattts_serve.bench.stats import snr_db as _snr_db
from chattts_serve.models.chattts.checkpoint import load

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load(tiny_ckpt)


@pytest.mark.parametrize(
    ("runtime", "min_db", "module"),
    [
        ("ort-fp32", 80.0, "onnxruntime"),
        pytest.param("ov-fp32", 80.0, "openvino", marks=pytest.mark.slow),  # ort-fp32's check, OpenVINO's graph
        ("ov-bf16", 25.0, "openvino"),
        ("ov-int8", 15.0, "nncf"),
    ],
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


def _windows(model, lengths: list[int]):
    from chattts_serve.audio.policy import StreamPolicy
    from chattts_serve.audio.stream import AudioStream, Window

    g = torch.Generator().manual_seed(5)
    out = []
    for n in lengths:
        stream = AudioStream(StreamPolicy.one_shot(), model.config.gpt.hidden_size, n, torch.device("cpu"))
        stream.hidden.copy_(torch.randn(n, model.config.gpt.hidden_size, generator=g))
        out.append(Window(stream, 0, n, 0, 512 * n - 256, n, True))
    return out


@pytest.mark.parametrize("buckets", [False, True])
def test_audio_dtype_ort_fp32_decodes_each_window_as_fp32_does(model, buckets):
    """Through ``decode_windows``: equal-length batches, and (buckets) right-padded rows, which the graph
    decodes by their true length."""
    pytest.importorskip("onnxruntime")
    windows = _windows(model, [6, 6, 9, 3, 14, 6])
    ref = decode_windows(model, windows, "fp32", buckets=buckets)
    out = decode_windows(model, windows, "ort-fp32", buckets=buckets)
    for n, a, b in zip([6, 6, 9, 3, 14, 6], ref, out, strict=True):
        assert a.shape == b.shape == (512 * n - 256,)
        assert _snr_db(torch.from_numpy(a), torch.from_numpy(b)) > 80
    assert graph_for(model, "ort-fp32") is graph_for(model, "ort-fp32")  # built once per model


def test_graph_runtimes_are_cpu_only_and_listed_in_the_config():
    from chattts_serve.audio.cpu_graph import RUNTIMES
    from chattts_serve.audio.decode import _DTYPES
    from chattts_serve.engine.config import AUDIO_DTYPES, AUDIO_GRAPH_DTYPES, EngineConfig
    from chattts_serve.engine.plan import resolve_plan

    assert ("auto", *_DTYPES) == AUDIO_DTYPES and RUNTIMES == AUDIO_GRAPH_DTYPES
    assert resolve_plan(EngineConfig(audio_dtype="ov-bf16"), "cpu").audio_dtype == "ov-bf16"
    with pytest.raises(ValueError, match="CPU only"):
        resolve_plan(EngineConfig(audio_dtype="ort-fp32"), "cuda")


def test_an_engine_with_audio_dtype_ort_fp32_gives_the_fp32_audio(tiny_ckpt):
    pytest.importorskip("onnxruntime")
    from chattts_serve import Engine, SamplingParams
    from chattts_serve.engine.config import EngineConfig

    params = SamplingParams(seed=3, refine_text=False, min_new_tokens=30, max_new_tokens=30)
    audio = {}
    for dtype in ("fp32", "ort-fp32"):
        engine = Engine.from_pretrained(tiny_ckpt, config=EngineConfig.with_slots(1, audio_dtype=dtype))
        [result] = engine.synthesize("今天天气真不错。", params)
        audio[dtype] = torch.from_numpy(result.audio)
    assert audio["fp32"].shape == audio["ort-fp32"].shape
    assert _snr_db(audio["fp32"], audio["ort-fp32"]) > 80  # the same codes; only the audio stage's rounding
