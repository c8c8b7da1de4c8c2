"""Loading: strict keys, the ``module.`` prefix, weight norm folded as the package computes it, resolve."""

from __future__ import annotations

import pytest
import torch

from chattts_serve.models.kokoro import checkpoint as ck
from chattts_serve.models.kokoro.checkpoint import CheckpointError, fold_weight_norm, is_kokoro_dir, load, resolve
from chattts_serve.models.kokoro.config import KokoroConfig


def _rewrite(src, dst, edit):
    import shutil

    shutil.copytree(src, dst)
    blob = torch.load(dst / ck.WEIGHTS_FILE, weights_only=True)
    edit(blob)
    torch.save(blob, dst / ck.WEIGHTS_FILE)
    return dst


def test_loads_and_is_detected(kokoro_tiny, kokoro_model):
    assert is_kokoro_dir(kokoro_tiny)
    assert resolve(kokoro_tiny) == kokoro_tiny
    assert not kokoro_model.training


def test_missing_key_is_named(kokoro_tiny, tmp_path):
    root = _rewrite(kokoro_tiny, tmp_path / "c", lambda b: b["decoder"].pop("module.generator.conv_post.bias"))
    with pytest.raises(CheckpointError, match=r"\['decoder'\].*missing 1 key\(s\): generator.conv_post.bias"):
        load(root)


def test_unexpected_key_is_named(kokoro_tiny, tmp_path):
    root = _rewrite(kokoro_tiny, tmp_path / "c", lambda b: b["bert"].update({"module.extra.weight": torch.zeros(1)}))
    with pytest.raises(CheckpointError, match="unexpected 1 key.*extra.weight"):
        load(root)


def test_missing_component_and_half_a_pair(kokoro_tiny, tmp_path):
    root = _rewrite(kokoro_tiny, tmp_path / "a", lambda b: b.pop("text_encoder"))
    with pytest.raises(CheckpointError, match="dict of the state dicts"):
        load(root)
    root = _rewrite(kokoro_tiny, tmp_path / "b", lambda b: b["decoder"].pop("module.F0_conv.weight_v"))
    with pytest.raises(CheckpointError, match="F0_conv.weight_g has no matching"):
        load(root)


def test_keys_without_the_prefix_load_too(kokoro_tiny, tmp_path, kokoro_model):
    def strip(blob):
        for name in list(blob):
            blob[name] = {k.removeprefix("module."): v for k, v in blob[name].items()}

    model = load(_rewrite(kokoro_tiny, tmp_path / "c", strip))
    for (k, a), b in zip(model.state_dict().items(), kokoro_model.state_dict().values(), strict=True):
        assert torch.equal(a, b), k


def test_affine_instance_norm_weights_are_taken_when_present(kokoro_tiny, tmp_path):
    """The package's own state_dict() carries AdaIN's norm.weight/bias; a file saved from it loads."""
    width = KokoroConfig.from_file(kokoro_tiny / "config.json").hidden_dim + 2  # the encode block's input

    def add(blob):
        blob["decoder"]["module.encode.norm1.norm.weight"] = torch.full((width,), 2.0)
        blob["decoder"]["module.encode.norm1.norm.bias"] = torch.zeros(width)

    model = load(_rewrite(kokoro_tiny, tmp_path / "c", add))
    assert torch.equal(model.decoder.encode.norm1.norm.weight, torch.full((width,), 2.0))


def test_fold_matches_torch_weight_norm_bit_for_bit():
    torch.manual_seed(0)
    for conv in (torch.nn.Conv1d(8, 6, 5), torch.nn.ConvTranspose1d(6, 4, 20, 10)):
        wn = torch.nn.utils.weight_norm(conv)
        with torch.no_grad():
            wn.weight_g.mul_(torch.rand_like(wn.weight_g) + 0.5)
            wn(torch.zeros(1, conv.in_channels, 40))  # the hook recomputes .weight from the pair
        folded = fold_weight_norm({"c.weight_g": wn.weight_g.detach(), "c.weight_v": wn.weight_v.detach()})
        assert torch.equal(folded["c.weight"], wn.weight.detach())


def test_resolve_errors(tmp_path, monkeypatch):
    with pytest.raises(CheckpointError, match="is incomplete; missing: config.json, kokoro-v1_0.pth"):
        resolve(tmp_path)
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointError, match="is a file"):
        resolve(tmp_path / "f")
    with pytest.raises(CheckpointError, match="not a Hugging Face repo id"):
        resolve("./nowhere")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match="could not get 'hexgrad/Kokoro-82M'.*Download the Kokoro weights"):
        resolve("hexgrad/Kokoro-82M")


def test_resolve_asks_the_hub_for_the_official_files_only(monkeypatch, kokoro_tiny):
    seen = {}

    def fake(repo_id, revision, allow_patterns):
        seen.update(repo=repo_id, patterns=allow_patterns)
        return str(kokoro_tiny)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert resolve("hexgrad/Kokoro-82M") == kokoro_tiny
    assert seen == {"repo": "hexgrad/Kokoro-82M", "patterns": ["config.json", "kokoro-v1_0.pth", "voices/*.pt"]}


def test_not_a_kokoro_dir(tmp_path):
    assert not is_kokoro_dir(tmp_path)
    (tmp_path / "kokoro-v1_0.pth").write_bytes(b"")
    (tmp_path / "config.json").write_text('{"gpt": {}}')
    assert not is_kokoro_dir(tmp_path)
