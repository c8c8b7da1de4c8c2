"""Voice packs: loading, blending, the style row for a phoneme count."""

from __future__ import annotations

import pytest
import torch

from chattts_serve.models.kokoro.voices import VoiceError, blend_voices, load_voice, style_for, voice_names


def test_load_voice(kokoro_tiny):
    pack = load_voice(kokoro_tiny, "af_heart")
    assert pack.shape == (510, 1, 256) and pack.dtype == torch.float32
    assert {"af_heart", "af_bella", "af_sky", "zf_xiaobei", "zm_yunjian"} <= set(voice_names(kokoro_tiny))


def test_unknown_and_malformed_names(kokoro_tiny):
    with pytest.raises(VoiceError, match="no voice 'af_nobody'.*known: .*af_heart"):
        load_voice(kokoro_tiny, "af_nobody")
    with pytest.raises(VoiceError, match="not of the form"):
        load_voice(kokoro_tiny, "../config")


def test_not_a_pack(tmp_path):
    (tmp_path / "voices").mkdir()
    torch.save(torch.zeros(3, 256), tmp_path / "voices" / "af_flat.pt")
    with pytest.raises(VoiceError, match=r"expected a \[510, 1, 256\] tensor"):
        load_voice(tmp_path, "af_flat")


def test_blend_is_the_weighted_mean(kokoro_tiny):
    a, b = load_voice(kokoro_tiny, "af_bella"), load_voice(kokoro_tiny, "af_sky")
    torch.testing.assert_close(blend_voices([(a, 2.0), (b, 1.0)]), (2 * a + b) / 3)
    assert torch.equal(blend_voices([(a, 1.0)]), a)
    with pytest.raises(VoiceError, match="positive"):
        blend_voices([(a, 0.0)])
    with pytest.raises(VoiceError, match="at least one"):
        blend_voices([])


def test_style_row_is_phoneme_count_minus_one(kokoro_tiny):
    pack = load_voice(kokoro_tiny, "af_heart")
    assert torch.equal(style_for(pack, 1), pack[0]) and torch.equal(style_for(pack, 510), pack[509])
    with pytest.raises(VoiceError, match="1..510"):
        style_for(pack, 511)
