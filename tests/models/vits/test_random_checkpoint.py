"""write_random: the MMS-TTS hub layout, every file and field, deterministic bytes, the official sizes."""

from __future__ import annotations

import hashlib
import json

import torch
from safetensors import safe_open

from chattts_serve.models.vits.checkpoint import hub_state_dict
from chattts_serve.models.vits.config import VitsConfig
from chattts_serve.models.vits.model import Utterance, VitsModel
from chattts_serve.models.vits.random_checkpoint import CONV_POST_SCALE, MMS_ENG_VOCAB, write_random

HUB_FILES = {"config.json", "model.safetensors", "vocab.json", "tokenizer_config.json", "special_tokens_map.json",
             "added_tokens.json"}


def _hashes(root):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in root.iterdir()}


def test_layout_and_fields(vits_tiny):
    assert {p.name for p in vits_tiny.iterdir()} == HUB_FILES
    raw = json.loads((vits_tiny / "config.json").read_text())
    assert list(raw) == sorted(raw)  # transformers writes config.json with sorted keys
    assert raw["model_type"] == "vits" and raw["architectures"] == ["VitsModel"] and raw["torch_dtype"] == "float32"
    assert set(VitsConfig().to_dict()) <= set(raw)
    assert json.loads((vits_tiny / "vocab.json").read_text()) == MMS_ENG_VOCAB
    tok = json.loads((vits_tiny / "tokenizer_config.json").read_text())
    assert tok["tokenizer_class"] == "VitsTokenizer" and tok["pad_token"] == "k" and tok["phonemize"] is False
    assert json.loads((vits_tiny / "special_tokens_map.json").read_text()) == {"pad_token": "k", "unk_token": "<unk>"}
    assert json.loads((vits_tiny / "added_tokens.json").read_text()) == {"<unk>": 38}
    with safe_open(vits_tiny / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}


def test_same_seed_same_bytes(tmp_path):
    a = write_random(tmp_path / "a", "tiny", seed=3)
    b = write_random(tmp_path / "b", "tiny", seed=3)
    c = write_random(tmp_path / "c", "tiny", seed=4)
    assert _hashes(a) == _hashes(b)
    assert _hashes(a)["model.safetensors"] != _hashes(c)["model.safetensors"]


def test_full_size_is_mms_tts():
    """The full layout is transformers' VitsModel at MMS-TTS English's sizes: 762 tensors, 36,284,592 values
    (both counted on transformers 5.24's state dict, weight-norm pairs renamed to the hub's names; the live
    reference test compares every name and shape). Checked without writing 145 MB."""
    state = hub_state_dict(VitsModel(VitsConfig()))
    assert (len(state), sum(v.numel() for v in state.values())) == (762, 36_284_592)


def test_the_decoder_is_scaled_so_the_tanh_does_not_saturate(vits_tiny, vits_model):
    assert CONV_POST_SCALE == 0.002
    utt = Utterance([0, 6, 0, 7, 0, 21, 0, 21, 0, 22, 0], generator=torch.Generator().manual_seed(0))
    syn = vits_model.synthesize([utt])[0]
    assert 1e-3 < float(syn.audio.abs().max()) < 0.9
