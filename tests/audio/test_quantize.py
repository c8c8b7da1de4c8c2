"""audio/quantize.py: the audio graph's int8 kinds keep the waveform near torch fp32's on the model's own hidden
states, calibration repeats, and the head's projection is the MatMul left out."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chattts_serve.audio.decode import _decode_batch
from chattts_serve.bench.stats import snr_db as _snr_db
from chattts_serve.models.chattts.checkpoint import load

pytestmark = [pytest.mark.timeout(300)]
ov = pytest.importorskip("openvino")
pytest.importorskip("nncf")


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load(tiny_ckpt)


def test_calibration_is_the_trunks_output_and_repeats(model):
    from chattts_serve.audio.quantize import calibration_hidden

    a, b = calibration_hidden(model, (9, 5)), calibration_hidden(model, (9, 5))
    assert [x.shape for x in a] == [(1, 9, model.config.gpt.hidden_size), (1, 5, model.config.gpt.hidden_size)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert all(np.isfinite(x).all() and x.std() > 0 for x in a)


def test_calibration_reads_the_gpt_again_when_an_onnx_trunk_left_it_on_meta(tiny_ckpt):
    from chattts_serve.audio.quantize import calibration_hidden

    model = load(tiny_ckpt)
    before = calibration_hidden(model, (7,))
    model.gpt.to("meta")  # as prepare does under the ort-* precisions
    after = calibration_hidden(model, (7,))
    assert np.array_equal(before[0], after[0]) and next(model.gpt.parameters()).is_meta


def test_the_head_projection_is_the_output_matmul(model):
    from chattts_serve.audio.cpu_graph import convert
    from chattts_serve.audio.quantize import head_projection

    graph = convert(model)
    name = head_projection(graph)
    matmuls = [op.get_friendly_name() for op in graph.get_ordered_ops() if op.get_type_name() == "MatMul"]
    assert name == matmuls[-1] and len(matmuls) == 2 * 2 + 2 * 2 + 1  # 2 blocks x 2 linears in each stack + head


@pytest.mark.parametrize("kind", ["smooth", pytest.param("dynamic", marks=pytest.mark.slow)])
def test_an_int8_graph_gives_the_fp32_waveform_to_int8s_precision(model, kind):
    from chattts_serve.audio.cpu_graph import compile_graph, convert
    from chattts_serve.audio.quantize import DYNAMIC_GROUP, calibration_hidden, quantize
    from chattts_serve.models.chattts.vocos import istft, spectrum_of_projection

    feeds = calibration_hidden(model, (24, 12))
    graph = quantize(convert(model), feeds, kind)
    assert any(op.get_type_name() in ("FakeQuantize", "Convert") for op in graph.get_ordered_ops())
    extra = {"DYNAMIC_QUANTIZATION_GROUP_SIZE": DYNAMIC_GROUP} if kind == "dynamic" else None
    run = compile_graph(graph, "bf16", 1, extra)
    h = torch.from_numpy(calibration_hidden(model, (17,), seed=1)[0])  # other hidden states than calibration's
    x = torch.from_numpy(np.asarray(run(h.numpy())))
    head = model.vocos.head
    wav = istft(spectrum_of_projection(x), head.istft.window)
    ref = _decode_batch(model, h, "fp32", None)
    assert wav.shape == ref.shape == (1, 512 * 17 - 256)
    assert _snr_db(ref, wav) > 15


def test_an_unknown_kind_is_refused(model):
    from chattts_serve.audio.quantize import quantize

    with pytest.raises(ValueError, match="int8 kind must be one of"):
        quantize(None, [], "int4")


def test_ov_int8_decodes_a_row_alone_as_in_a_batch(model):
    """Static scales (calibrated once): a row's quantization does not depend on the rows beside it."""
    from chattts_serve.audio.cpu_graph import AudioGraph

    graph = AudioGraph(model, "ov-int8", threads=1)
    h = torch.randn(4, 21, model.config.gpt.hidden_size, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([graph.decode(h[i : i + 1]) for i in range(4)])
    assert torch.equal(alone, graph.decode(h))
