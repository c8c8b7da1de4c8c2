"""models/chattts/random_checkpoint.py: the random-weight checkpoint generator writes the official layout,
deterministically."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from chattts_serve.models.chattts import checkpoint
from chattts_serve.models.chattts.checkpoint import read_config
from chattts_serve.models.chattts.config import ConvStackConfig, DecoderConfig, GPTConfig, ModelConfig
from chattts_serve.models.chattts.random_checkpoint import write_random

from .test_checkpoint import OFFICIAL_FILES, SAFETENSORS


def all_files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def test_write_random_is_deterministic(tmp_path, tiny_ckpt):
    a = write_random(tmp_path / "a", "tiny", seed=0)
    b = write_random(tmp_path / "b", "tiny", seed=0)
    c = write_random(tmp_path / "c", "tiny", seed=1)
    files = all_files(a)
    assert files == all_files(b) == all_files(c) == all_files(tiny_ckpt)
    for rel in files:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
        assert (a / rel).read_bytes() == (tiny_ckpt / rel).read_bytes(), rel  # the fixture uses seed 0
    for rel in SAFETENSORS + [checkpoint.SPK_STAT]:
        assert (a / rel).read_bytes() != (c / rel).read_bytes(), rel
    # a different seed changes the weights themselves, not just the metadata
    wa, wc = load_file(a / "asset/gpt/model.safetensors"), load_file(c / "asset/gpt/model.safetensors")
    assert wa.keys() == wc.keys()
    assert all(not torch.equal(wa[k], wc[k]) for k in wa)


def test_write_random_file_list_tiny(tiny_ckpt):
    # hidden size 64 != 768: our optional speaker statistics are written too
    assert all_files(tiny_ckpt) == OFFICIAL_FILES | {"asset/spk_stat.txt"}


def test_write_random_768_has_no_spk_stat(tmp_path):
    tiny = ModelConfig.tiny()
    cfg = ModelConfig(
        gpt=GPTConfig(hidden_size=768, num_layers=1, num_heads=12, num_kv_heads=12, intermediate_size=16),
        decoder=DecoderConfig(ConvStackConfig(idim=384, odim=16, hidden=8, num_layers=1, bn_dim=8)),
        dvae=tiny.dvae,
        vocos=tiny.vocos,
    )
    root = write_random(tmp_path / "ck", cfg, seed=0)
    assert all_files(root) == OFFICIAL_FILES
    assert read_config(root) == cfg


def test_write_random_rejects_unknown_size(tmp_path):
    with pytest.raises(ValueError, match="size"):
        write_random(tmp_path / "x", "medium")
