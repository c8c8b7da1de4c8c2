"""VITS's precision modes (``models.vits.kernels``): durations exact in every mode, the waveform within each mode's
measured bound of fp32's, every row the same alone and in a batch, and clear refusals."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from chattts_serve import SamplingParams
from chattts_serve.bench.stats import snr_db
from chattts_serve.engine.config import EngineConfig
from chattts_serve.engine.engine import Engine
from chattts_serve.models.vits import kernels
from chattts_serve.models.vits.checkpoint import load
from chattts_serve.models.vits.model import Utterance
from chattts_serve.models.vits.random_checkpoint import write_random

from .test_model import SENTENCES, _fresh, _utterances

MIN_SNR_DB = {"ort-fp32": 90.0, "bf16": 20.0, "torch-bf16": 20.0, "int8": 20.0}
"""Each mode's floor against fp32 on the tiny checkpoint. Measured there (min of 8 requests): ort-fp32 122 dB,
bf16 (OpenVINO) 40 dB, torch bf16 36 dB, int8 (OpenVINO) 34 dB; on the full-size one: 106 dB, 33 dB and 24 dB
(docs/vits.md)."""
TORCH_BF16_BATCH_BOUND = 1e-3
"""torch bf16's padded batch against each row alone (its masks hold the rows apart; other blockings may round
differently: measured 0 on the CPU with the tiny checkpoint, whose audio peaks near 0.08)."""


def _moded(root, mode: str):
    model = load(root)
    if mode == "torch-bf16":
        kernels.torch_bf16(model)
    else:
        kernels.attach(model, mode)
    return model


@pytest.fixture(scope="module", params=["ort-fp32", "bf16", "torch-bf16", "int8"])
def mode(request, vits_tiny):
    if request.param == "ort-fp32":
        pytest.importorskip("onnxruntime")
    if request.param in ("bf16", "int8"):
        pytest.importorskip("openvino")
    if request.param == "int8":
        pytest.importorskip("nncf")
    return request.param, _moded(vits_tiny, request.param)


def test_durations_exact_and_the_waveform_within_the_modes_bound(mode, vits_model, vits_tokenizer):
    name, model = mode
    batch = _utterances(vits_tokenizer, 8, seed=3)
    reference = vits_model.synthesize([_fresh(u, 100 + i) for i, u in enumerate(batch)])
    moded = model.synthesize([_fresh(u, 100 + i) for i, u in enumerate(batch)])
    for ref, got in zip(reference, moded, strict=True):
        np.testing.assert_array_equal(got.durations.numpy(), ref.durations.numpy())
        assert got.audio.shape == ref.audio.shape and got.audio.dtype == torch.float32
        assert snr_db(ref.audio, got.audio) >= MIN_SNR_DB[name], name


def test_every_row_equals_itself_alone(mode, vits_tokenizer):
    """The CPU modes run rows one by one: a row's audio is bit for bit itself alone. torch bf16 (an accelerator's
    mode) is forced through one padded batch here: its masks hold the rows apart within a bound."""
    name, model = mode
    if name == "torch-bf16":
        model.batch_decoder, model.max_padding = True, float("inf")
    batch = _utterances(vits_tokenizer, 5, seed=5)
    together = model.synthesize([_fresh(u, 100 + i) for i, u in enumerate(batch)])
    for i, utt in enumerate(batch):
        alone = model.synthesize([_fresh(utt, 100 + i)])[0]
        np.testing.assert_array_equal(together[i].durations.numpy(), alone.durations.numpy())
        if name == "torch-bf16":
            assert float((together[i].audio - alone.audio).abs().max()) <= TORCH_BF16_BATCH_BOUND
        else:
            assert torch.equal(together[i].audio, alone.audio)


def test_streamed_pieces_join_to_the_whole_in_torch_bf16(vits_tiny, vits_tokenizer):
    model = _moded(vits_tiny, "torch-bf16")
    utt = Utterance(vits_tokenizer.encode(SENTENCES[2]), generator=torch.Generator().manual_seed(1))
    whole = model.synthesize([utt])[0].audio
    _, pieces = model.stream(_fresh(utt, 1), chunk_frames=8)
    joined = torch.cat(list(pieces))
    assert joined.shape == whole.shape and float((joined - whole).abs().max()) <= TORCH_BF16_BATCH_BOUND


@pytest.mark.parametrize("name", ["ort-fp32", "bf16", "int8"])
def test_a_multi_speaker_checkpoint_in_a_cpu_mode(tmp_path, vits_tokenizer, name):
    pytest.importorskip("onnxruntime" if name == "ort-fp32" else "openvino")
    if name == "int8":
        pytest.importorskip("nncf")
    root = write_random(tmp_path / "ms", "tiny", seed=1, num_speakers=3, speaker_embedding_size=8)
    fp32, moded = load(root), _moded(root, name)
    ids = vits_tokenizer.encode(SENTENCES[0])
    for speaker in (0, 2):
        ref, got = (
            m.synthesize([Utterance(ids, speaker_id=speaker, generator=torch.Generator().manual_seed(4))])[0]
            for m in (fp32, moded)
        )
        np.testing.assert_array_equal(got.durations.numpy(), ref.durations.numpy())
        assert snr_db(ref.audio, got.audio) >= MIN_SNR_DB[name]


def test_the_engine_serves_a_mode_and_refuses_another_familys(vits_tiny):
    pytest.importorskip("onnxruntime")
    fp32 = Engine.from_pretrained(vits_tiny, config=EngineConfig())
    ort = Engine.from_pretrained(vits_tiny, config=EngineConfig(precision="ort-fp32"))
    [a] = fp32.synthesize("Hello there.", SamplingParams(seed=3))
    [b] = ort.synthesize("Hello there.", SamplingParams(seed=3))
    assert a.audio.shape == b.audio.shape and snr_db(torch.from_numpy(a.audio), torch.from_numpy(b.audio)) > 90
    for precision in ("int8-dynamic", "fp16", "ort-int4"):
        with pytest.raises(ValueError, match=f"runs in fp32, bf16, ort-fp32, int8; --precision {precision}"):
            Engine.from_pretrained(vits_tiny, config=EngineConfig(precision=precision))


@pytest.mark.parametrize("name", ["ort-fp32", "int8"])
def test_a_cpu_only_mode_is_refused_on_an_accelerator(name):
    with pytest.raises(ValueError, match=f"{name} runs VITS on the CPU"):
        kernels.check_mode(name, torch.device("cuda"))
    kernels.check_mode("bf16", torch.device("cuda"))


def test_int8_without_nncf_names_the_extra(monkeypatch):
    """The [openvino] extra pins nncf; an install without it is told so, not given a bare ImportError."""
    monkeypatch.setitem(sys.modules, "nncf", None)
    with pytest.raises(ValueError, match=r"--precision int8 .*nncf: the \[openvino\] extra"):
        kernels.int8_weights(object())


def test_int8_compresses_every_decoder_convolution(vits_model):
    """The mode is int8 in fact: nncf's data-free compression reaches each of the decoder's convolutions (a
    silently skipped layer would leave the SNR bound met and the mode a relabelled f32)."""
    ov = pytest.importorskip("openvino")
    pytest.importorskip("nncf")
    graph = kernels.export_onnx(vits_model, kernels.Decoder(vits_model.decoder))
    compressed = kernels.int8_weights(ov.Core().read_model(graph, b""))
    kinds = ("Convolution", "ConvolutionBackpropData")
    convolutions = [op for op in compressed.get_ops() if op.get_type_name() in kinds]
    assert convolutions and all(_weight_constant(op).get_element_type() == ov.Type.u8 for op in convolutions)


def _weight_constant(convolution):
    """The constant a convolution's weights come from, up through nncf's decompression (Convert, Subtract of the
    zero point, Multiply by the scale: the quantized values are each one's first input) and any Reshape."""
    node = convolution.input_value(1).get_node()
    while node.get_type_name() != "Constant":
        node = node.input_value(0).get_node()
    return node
