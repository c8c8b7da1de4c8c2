"""models/chattts/checkpoint.py: official parameter counts, config reading, load errors (the random-weight
generator that writes ``tiny_ckpt`` is tested in test_random_checkpoint.py)."""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from chattts_serve.models.chattts import checkpoint
from chattts_serve.models.chattts.checkpoint import CheckpointError, load, read_config
from chattts_serve.models.chattts.config import GPTConfig, ModelConfig
from chattts_serve.models.chattts.dvae import DVAE, Decoder
from chattts_serve.models.chattts.embed import Embed
from chattts_serve.models.chattts.gpt import GPT
from chattts_serve.models.chattts.vocos import Vocos

OFFICIAL_FILES = {
    "asset/gpt/config.json",
    "asset/gpt/model.safetensors",
    "asset/Embed.safetensors",
    "asset/Decoder.safetensors",
    "asset/DVAE.safetensors",
    "asset/Vocos.safetensors",
    "asset/tokenizer/tokenizer.json",
    "asset/tokenizer/tokenizer_config.json",
    "asset/tokenizer/special_tokens_map.json",
}
SAFETENSORS = sorted(f for f in OFFICIAL_FILES if f.endswith(".safetensors"))


def n_params(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def embed_numel_as_stored(cfg: GPTConfig) -> int:
    """Embed.safetensors: 4 code embeddings, text embedding, weight-normed heads (g [N, 1] and v [N, H])."""
    h, a, t, q = cfg.hidden_size, cfg.num_audio_tokens, cfg.num_text_tokens, cfg.num_vq
    return q * a * h + t * h + t * (1 + h) + q * a * (1 + h)


# ---------------------------------------------------------------- official sizes


def test_tiny_embed_file_numel_matches_formula(tiny_ckpt):
    with safe_open(str(tiny_ckpt / "asset/Embed.safetensors"), "pt") as f:
        total = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert total == embed_numel_as_stored(ModelConfig.tiny().gpt)


def test_full_config_parameter_counts_are_official():
    cfg = ModelConfig.full()
    with torch.device("meta"):
        gpt, embed = GPT(cfg.gpt), Embed(cfg.gpt)
        decoder, dvae, vocos = Decoder(cfg.decoder), DVAE(cfg.dvae), Vocos(cfg.vocos)
    assert n_params(gpt) == 188_775_168
    # Embed holds folded heads; the file stores g [N, 1] and v [N, H] per head.
    g_rows = cfg.gpt.num_text_tokens + cfg.gpt.num_vq * cfg.gpt.num_audio_tokens
    assert embed_numel_as_stored(cfg.gpt) == 36_399_234
    assert n_params(embed) + g_rows == 36_399_234
    assert n_params(decoder) == 25_920_640
    assert n_params(dvae) == 15_031_048
    assert n_params(vocos) == 13_531_650
    # the buffers are not learned parameters
    assert {n for n, _ in decoder.named_buffers()} == {"coef"}
    dvae_buffers = {n for n, _ in dvae.named_buffers()}
    assert {"coef", "preprocessor_mel.mel_spec.spectrogram.window", "preprocessor_mel.mel_spec.mel_scale.fb"} <= (
        dvae_buffers
    )
    assert {n for n, _ in vocos.named_buffers()} == {
        "feature_extractor.mel_spec.spectrogram.window",
        "feature_extractor.mel_spec.mel_scale.fb",
        "head.istft.window",
    }


# ---------------------------------------------------------------- reading and loading


def test_read_config_tiny(tiny_ckpt):
    assert read_config(tiny_ckpt) == ModelConfig.tiny()


def test_load_tiny_has_no_meta_tensors_and_is_eval(tiny_ckpt):
    m = load(tiny_ckpt)
    assert m.config == ModelConfig.tiny()
    assert m.root == Path(tiny_ckpt)
    for mod in (m.gpt, m.embed, m.decoder, m.dvae, m.vocos):
        for name, t in list(mod.named_parameters()) + list(mod.named_buffers()):
            assert not t.is_meta, name
            assert t.device.type == "cpu", name
        for p in mod.parameters():
            assert not p.requires_grad
        assert all(not sub.training for sub in mod.modules())
    for p in m.gpt.parameters():
        assert p.dtype == torch.float32


def test_load_dtype_applies_to_gpt_only(tiny_ckpt):
    m = load(tiny_ckpt, dtype=torch.bfloat16)
    assert {p.dtype for p in m.gpt.parameters()} == {torch.bfloat16}
    for mod in (m.embed, m.decoder, m.dvae, m.vocos):
        assert {p.dtype for p in mod.parameters()} == {torch.float32}


def test_load_weights_equal_file(tiny_ckpt):
    m = load(tiny_ckpt)
    sd = load_file(tiny_ckpt / "asset/Vocos.safetensors")
    for k, v in m.vocos.state_dict().items():
        torch.testing.assert_close(v, sd[k], rtol=0, atol=0)
    gsd = load_file(tiny_ckpt / "asset/gpt/model.safetensors")
    torch.testing.assert_close(m.gpt.layers[1].mlp.up_proj.weight, gsd["layers.1.mlp.up_proj.weight"], rtol=0, atol=0)


def test_load_nonexistent_directory(tmp_path):
    missing = tmp_path / "no" / "such" / "dir"
    with pytest.raises(CheckpointError, match="no checkpoint directory") as ei:
        load(missing)
    assert str(missing) in str(ei.value)


@pytest.mark.parametrize("bad", ["not a repo", "a/b/c", "nothing_here"])
def test_load_not_a_repo_id(bad, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        load(bad)


def test_load_path_is_a_file(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="is a file"):
        load(f)


def linked_copy(src: Path, dst: Path) -> Path:
    """A checkpoint copy made of symlinks (cheap); replace a file with ``os.remove`` before writing it."""
    shutil.copytree(src, dst, copy_function=os.symlink)
    return dst


@pytest.mark.parametrize("rel", sorted(checkpoint.REQUIRED_FILES))
def test_load_directory_missing_a_file(rel, tiny_ckpt, tmp_path):
    root = linked_copy(tiny_ckpt, tmp_path / "ck")
    os.remove(root / rel)
    with pytest.raises(CheckpointError, match="incomplete") as ei:
        load(root)
    assert rel in str(ei.value)


def rewrite(root: Path, rel: str, edit) -> None:
    sd = load_file(root / rel)
    edit(sd)
    os.remove(root / rel)
    save_file(sd, str(root / rel))


@pytest.mark.parametrize(
    "rel,name",
    [
        ("asset/gpt/model.safetensors", "layers.0.self_attn.k_proj.weight"),
        ("asset/gpt/model.safetensors", "norm.weight"),
        ("asset/Embed.safetensors", "emb_code.3.weight"),
        ("asset/Embed.safetensors", "head_code.2.parametrizations.weight.original0"),
        ("asset/Decoder.safetensors", "out_conv.weight"),
        ("asset/Decoder.safetensors", "coef"),
        ("asset/DVAE.safetensors", "vq_layer.quantizer.rvqs.1.project_out.bias"),
        ("asset/Vocos.safetensors", "head.out.bias"),
    ],
)
def test_load_missing_tensor(rel, name, tiny_ckpt, tmp_path):
    root = linked_copy(tiny_ckpt, tmp_path / "ck")
    rewrite(root, rel, lambda sd: sd.pop(name))
    with pytest.raises(CheckpointError) as ei:
        load(root)
    msg = str(ei.value)
    assert rel in msg and name in msg and "missing" in msg


@pytest.mark.parametrize(
    "rel,name,new_shape",
    [
        ("asset/gpt/model.safetensors", "layers.1.mlp.down_proj.weight", (64, 127)),
        ("asset/Embed.safetensors", "emb_text.weight", (21178, 65)),
        ("asset/Decoder.safetensors", "coef", (1, 100, 2)),
        ("asset/DVAE.safetensors", "out_conv.weight", (100, 32, 2)),
        ("asset/Vocos.safetensors", "head.out.bias", (1025,)),
        # Weight-norm heads are folded at load: their shapes are checked before (no crash, no misread).
        ("asset/Embed.safetensors", "head_code.1.parametrizations.weight.original0", (626, 0)),
        ("asset/Embed.safetensors", "head_text.parametrizations.weight.original0", (21177, 1)),
        ("asset/Embed.safetensors", "head_code.1.parametrizations.weight.original1", (626, 63)),
    ],
)
def test_load_wrong_shape(rel, name, new_shape, tiny_ckpt, tmp_path):
    root = linked_copy(tiny_ckpt, tmp_path / "ck")
    old_shape = tuple(load_file(tiny_ckpt / rel)[name].shape)

    def edit(sd):
        sd[name] = torch.zeros(new_shape)

    rewrite(root, rel, edit)
    with pytest.raises(CheckpointError) as ei:
        load(root)
    msg = str(ei.value)
    assert rel in msg and name in msg
    assert str(new_shape) in msg and str(old_shape) in msg


def test_load_unreadable_safetensors(tiny_ckpt, tmp_path):
    root = linked_copy(tiny_ckpt, tmp_path / "ck")
    os.remove(root / "asset/Vocos.safetensors")
    (root / "asset/Vocos.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="asset/Vocos.safetensors"):
        load(root)


def test_load_bad_config_json(tiny_ckpt, tmp_path):
    root = linked_copy(tiny_ckpt, tmp_path / "ck")
    os.remove(root / "asset/gpt/config.json")
    (root / "asset/gpt/config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="asset/gpt/config.json"):
        load(root)


def test_load_repo_id_offline_says_how_to_get_weights(tmp_path, monkeypatch):
    import huggingface_hub.constants as hf_constants

    hf_home = tmp_path / "hf_home"
    hf_home.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(hf_home))
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE"):
        monkeypatch.delenv(var, raising=False)
    # huggingface_hub reads these once at import time
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hf_constants, "HF_HOME", str(hf_home))
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    # and a hard guarantee that nothing reaches the network
    attempts = []

    def no_network(self, *args, **kwargs):
        attempts.append(args)
        raise OSError("network disabled in tests")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket.socket, "connect_ex", no_network)
    monkeypatch.chdir(tmp_path)

    with pytest.raises(CheckpointError) as ei:
        load("2Noise/ChatTTS")
    msg = str(ei.value)
    assert attempts == []
    assert "2Noise/ChatTTS" in msg
    assert "huggingface-cli download 2Noise/ChatTTS --local-dir" in msg
    assert "--model" in msg
    assert "checkpoint random" in msg
    assert "\n" not in msg


# ---------------------------------------------------------------------------------------------------
# What the official files may hold that our generator does not write (the asset audit of issue 9):
# the stored dtype is not known for certain, the trunk may carry the deleted `embed_tokens`, a
# config.json saved by transformers has more (and fewer) keys, and a download folder holds older files.


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_load_files_stored_in_half_precision(tiny_ckpt, tmp_path, dtype):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, ckpt)
    for rel in SAFETENSORS:
        tensors = load_file(str(ckpt / rel))
        save_file({k: v.to(dtype) for k, v in tensors.items()}, str(ckpt / rel), metadata={"format": "pt"})
    m = load(ckpt)
    for mod in (m.gpt, m.embed, m.decoder, m.dvae, m.vocos):
        assert {p.dtype for p in mod.parameters()} == {torch.float32}
    want = load_file(str(tiny_ckpt / "asset/gpt/model.safetensors"))["norm.weight"].to(dtype).float()
    assert torch.equal(m.gpt.norm.weight, want)


def test_load_trunk_with_embed_tokens_and_transformers_config(tiny_ckpt, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, ckpt)
    rel = "asset/gpt/model.safetensors"
    tensors = load_file(str(ckpt / rel))
    hidden = tensors["norm.weight"].shape[0]
    tensors["embed_tokens.weight"] = torch.zeros(32000, hidden)
    save_file(tensors, str(ckpt / rel), metadata={"format": "pt"})
    cfg_path = ckpt / "asset/gpt/config.json"
    cfg = json.loads(cfg_path.read_text())
    for key in ("num_audio_tokens", "num_text_tokens", "num_vq", "rope_theta"):
        cfg.pop(key)  # absent: the official defaults apply
    cfg.update(
        {"_name_or_path": "/data/gpt", "transformers_version": "4.41.2", "head_dim": 64 if hidden == 768 else None}
    )
    cfg_path.write_text(json.dumps(cfg))
    for old in ("asset/GPT.pt", "asset/DVAE_full.pt", "asset/tokenizer.pt", "config/gpt.yaml", "config/path.yaml"):
        (ckpt / old).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / old).write_bytes(b"older release files: ignored")
    m = load(ckpt)
    assert m.config == read_config(tiny_ckpt)
    assert torch.equal(m.gpt.norm.weight, load(tiny_ckpt).gpt.norm.weight)
