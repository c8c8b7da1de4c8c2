"""write_random: the official layout, exactly (names, prefixes, pairs, dtypes, voices, config)."""

from __future__ import annotations

import json

import pytest
import torch

from chattts_serve.models.kokoro.checkpoint import COMPONENTS, load
from chattts_serve.models.kokoro.config import OFFICIAL_CONFIG, KokoroConfig
from chattts_serve.models.kokoro.model import KokoroModel, Utterance
from chattts_serve.models.kokoro.random_checkpoint import OFFICIAL_VOICES, TINY_VOICES, write_random
from chattts_serve.models.kokoro.voices import load_voice, style_for

# Per component: (keys, parameters) of hexgrad/Kokoro-82M's kokoro-v1_0.pth, 81,763,410 in all: the
# package's "81.8M" (its AdaIN instance norms are built affine, but the file carries no affine tensors).
OFFICIAL_SIZES = {
    "bert": (25, 6_292_480),
    "bert_encoder": (2, 393_728),
    "predictor": (122, 16_194_612),
    "decoder": (375, 53_276_190),
    "text_encoder": (24, 5_606_400),
}


@pytest.mark.slow  # builds the 82M-parameter model
def test_full_size_parameter_count_is_the_official_one():
    from chattts_serve.models.kokoro.checkpoint import official_state_dicts

    sds = official_state_dicts(KokoroModel(KokoroConfig.official()))
    sizes = {name: (len(sd), sum(t.numel() for t in sd.values())) for name, sd in sds.items()}
    assert sizes == OFFICIAL_SIZES
    assert sum(n for _, n in sizes.values()) == 81_763_410


def test_tiny_layout(kokoro_tiny):
    blob = torch.load(kokoro_tiny / "kokoro-v1_0.pth", weights_only=True)
    assert list(blob) == list(COMPONENTS)
    for name, sd in blob.items():
        assert all(k.startswith("module.") for k in sd), name
        assert all(t.dtype == torch.float32 for t in sd.values()), name
        for key in sd:
            if key.endswith(".weight_g"):
                assert key[:-1] + "v" in sd
        assert not any(k.endswith("norm.weight") and ".norm1." in k for k in sd)
    assert "module.generator.conv_post.weight_g" in blob["decoder"]
    assert "module.encoder.albert_layer_groups.0.albert_layers.0.attention.query.weight" in blob["bert"]
    assert "module.cnn.0.1.gamma" in blob["text_encoder"]
    assert sorted(p.stem for p in (kokoro_tiny / "voices").glob("*.pt")) == sorted(TINY_VOICES)
    config = json.loads((kokoro_tiny / "config.json").read_text(encoding="utf-8"))
    # The official fields in the official order, then the decoder's widths (which the official file leaves out).
    assert list(config) == [*json.loads(OFFICIAL_CONFIG.read_text(encoding="utf-8")), "decoder_dim", "asr_res_dim"]
    assert sum(t.numel() for sd in blob.values() for t in sd.values()) < 2_000_000  # fast tier: seconds, not minutes
    assert config["vocab"] == dict(KokoroConfig.official().vocab)


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = write_random(tmp_path / "a", "tiny", seed=1, voices=("af_heart",))
    b = write_random(tmp_path / "b", "tiny", seed=1, voices=("af_heart",))
    c = write_random(tmp_path / "c", "tiny", seed=2, voices=("af_heart",))
    assert (a / "kokoro-v1_0.pth").read_bytes() == (b / "kokoro-v1_0.pth").read_bytes()
    assert (a / "voices/af_heart.pt").read_bytes() == (b / "voices/af_heart.pt").read_bytes()
    wa = torch.load(a / "kokoro-v1_0.pth", weights_only=True)["decoder"]["module.encode.conv1.weight_v"]
    wc = torch.load(c / "kokoro-v1_0.pth", weights_only=True)["decoder"]["module.encode.conv1.weight_v"]
    assert not torch.equal(wa, wc)


def test_biased_durations_last_a_few_frames(kokoro_model, kokoro_tiny):
    """Without the bias a random phoneme lasts ~25 frames; with it a few."""
    pack = load_voice(kokoro_tiny, "af_heart")
    ids = [0, *range(40, 70), 0]
    durations = kokoro_model.synthesize([Utterance(ids, style_for(pack, 30))])[0].durations
    assert 1 <= durations.float().mean().item() <= 6


def test_bad_size(tmp_path):
    with pytest.raises(ValueError, match="size must be"):
        write_random(tmp_path, "huge")  # type: ignore[arg-type]


@pytest.mark.slow
def test_full_size_checkpoint_loads_and_runs(tmp_path):
    root = write_random(tmp_path / "full", "full", seed=0)
    assert (root / "config.json").read_bytes() == OFFICIAL_CONFIG.read_bytes()
    assert sorted(p.stem for p in (root / "voices").glob("*.pt")) == sorted(OFFICIAL_VOICES)
    assert len(OFFICIAL_VOICES) == 54
    blob = torch.load(root / "kokoro-v1_0.pth", weights_only=True)
    assert sum(t.numel() for sd in blob.values() for t in sd.values()) == 81_763_410  # weight_g counted, as there
    model = load(root)
    pack = load_voice(root, "zf_xiaobei")
    out = model.synthesize([Utterance([0, 43, 156, 62, 83, 16, 55, 0], style_for(pack, 6),
                                      generator=torch.Generator().manual_seed(0))])[0]
    assert out.audio.shape[0] == int(out.durations.sum()) * 600
    assert torch.isfinite(out.audio).all()
