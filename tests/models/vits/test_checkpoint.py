"""Finding and strictly loading a VITS checkpoint; both weight-norm namings; clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from chattts_serve.models.vits.checkpoint import (
    HUB_PATTERNS,
    CheckpointError,
    fold_weight_norm,
    is_vits_dir,
    load,
    resolve,
)
from chattts_serve.models.vits.model import Utterance


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _speak(model):
    return model.synthesize([Utterance([0, 6, 0, 18, 0], generator=torch.Generator().manual_seed(0))])[0].audio


def test_resolve_and_detect(vits_tiny, tmp_path):
    assert resolve(vits_tiny) == vits_tiny
    assert is_vits_dir(vits_tiny)
    assert not is_vits_dir(tmp_path)
    incomplete = _copy(vits_tiny, tmp_path / "c")
    (incomplete / "vocab.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete; missing: vocab.json"):
        resolve(incomplete)
    with pytest.raises(CheckpointError, match="is a file"):
        resolve(vits_tiny / "config.json")
    with pytest.raises(CheckpointError, match="not a Hugging Face repo id"):
        resolve(tmp_path / "nothing")


def test_not_vits_is_not_detected(vits_tiny, tmp_path):
    other = _copy(vits_tiny, tmp_path / "c")
    raw = json.loads((other / "config.json").read_text())
    raw["model_type"] = "bert"
    (other / "config.json").write_text(json.dumps(raw))
    assert not is_vits_dir(other)
    with pytest.raises(CheckpointError, match="model_type is 'bert'"):
        load(other)


def test_hub_download_offline_is_a_clear_error(monkeypatch):
    import huggingface_hub

    seen = {}

    def fail(**kwargs):
        seen.update(kwargs)
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)
    with pytest.raises(CheckpointError, match=r"facebook/mms-tts-eng.*huggingface-cli download.*CC-BY-NC"):
        resolve("facebook/mms-tts-eng")
    assert seen["repo_id"] == "facebook/mms-tts-eng" and seen["allow_patterns"] == HUB_PATTERNS


def test_hub_download_returns_the_snapshot(monkeypatch, vits_tiny):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda **kw: str(vits_tiny))
    assert resolve("facebook/mms-tts-eng") == vits_tiny


def test_the_hub_file_uses_weight_g_and_weight_v(vits_tiny):
    keys = set(load_file(vits_tiny / "model.safetensors"))
    assert "flow.flows.0.wavenet.in_layers.0.weight_g" in keys
    assert "flow.flows.0.wavenet.in_layers.0.weight_v" in keys
    assert "posterior_encoder.wavenet.res_skip_layers.0.weight_g" in keys
    assert "decoder.upsampler.0.weight" in keys  # the decoder is not weight-normed in the hub files
    assert not any("parametrizations" in k for k in keys)


def test_transformers_5_names_load_the_same(vits_tiny, vits_model, tmp_path):
    renamed = _copy(vits_tiny, tmp_path / "c")
    state = load_file(renamed / "model.safetensors")
    new = {}
    for key, value in state.items():
        key = key.replace(".weight_g", ".parametrizations.weight.original0")
        new[key.replace(".weight_v", ".parametrizations.weight.original1")] = value
    save_file(new, renamed / "model.safetensors", metadata={"format": "pt"})
    assert torch.equal(_speak(load(renamed)), _speak(vits_model))


def test_weight_norm_folds_as_torch_parametrization(vits_tiny):
    state = load_file(vits_tiny / "model.safetensors")
    base = "flow.flows.0.wavenet.in_layers.0"
    conv = torch.nn.Conv1d(*state[base + ".weight_v"].shape[1::-1], state[base + ".weight_v"].shape[2])
    conv = torch.nn.utils.parametrizations.weight_norm(conv)
    conv.parametrizations.weight.original0.data.copy_(state[base + ".weight_g"])
    conv.parametrizations.weight.original1.data.copy_(state[base + ".weight_v"])
    assert torch.equal(fold_weight_norm(state)[base + ".weight"], conv.weight)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s.pop("decoder.conv_post.weight"), "missing 1 tensor.*decoder.conv_post.weight"),
        (lambda s: s.__setitem__("extra.weight", torch.zeros(1)), "unexpected 1 tensor.*extra.weight"),
        (lambda s: s.__setitem__("decoder.conv_post.weight", torch.zeros(1, 2, 3)),
         "decoder.conv_post.weight has shape"),
        (lambda s: s.pop("flow.flows.0.wavenet.in_layers.0.weight_v"), "weight_g has no matching"),
        (lambda s: s.pop("flow.flows.0.wavenet.in_layers.0.weight_g"), "weight_v has no matching"),
        (lambda s: s.__setitem__("decoder.conv_post.weight", torch.zeros(1, 8, 7, dtype=torch.int32)),
         "expected a floating-point tensor"),
    ],
)
def test_strict_load_names_the_tensor(vits_tiny, tmp_path, edit, message):
    broken = _copy(vits_tiny, tmp_path / "c")
    state = load_file(broken / "model.safetensors")
    edit(state)
    save_file(state, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match=message):
        load(broken)


def test_unreadable_weights(vits_tiny, tmp_path):
    broken = _copy(vits_tiny, tmp_path / "c")
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load(broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load(broken)


def test_the_training_only_posterior_encoder_is_freed(vits_model):
    assert vits_model.posterior_encoder is None
    assert not any(k.startswith("posterior_encoder.") for k in vits_model.state_dict())
