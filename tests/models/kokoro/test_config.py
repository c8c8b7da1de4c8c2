"""KokoroConfig: the public config.json, and clear errors for configs the network cannot run."""

from __future__ import annotations

import json

import pytest

from chattts_serve.models.kokoro.config import OFFICIAL_CONFIG, ConfigError, KokoroConfig


def test_official_config_fields():
    c = KokoroConfig.official()
    assert (c.n_token, c.hidden_dim, c.style_dim, c.n_layer, c.max_dur) == (178, 512, 128, 3, 50)
    assert c.text_encoder_kernel_size == 5
    assert c.plbert.hidden_size == 768 and c.plbert.num_hidden_layers == 12 and c.plbert.embedding_size == 128
    assert c.istftnet.upsample_rates == (10, 6) and c.istftnet.gen_istft_n_fft == 20
    assert c.sample_rate == 24000 and c.samples_per_frame == 600 and c.context_length == 512
    assert len(c.vocab) == 114 and c.vocab[";"] == 1 and c.vocab["ᵻ"] == 177 and c.vocab[" "] == 16


def test_round_trip_is_the_official_file():
    raw = json.loads(OFFICIAL_CONFIG.read_text(encoding="utf-8"))
    assert KokoroConfig.official().to_dict() == raw
    assert list(KokoroConfig.official().to_dict()) == list(raw)  # field order too


def test_decoder_widths_default_to_the_official_ones_and_round_trip():
    official = KokoroConfig.official()
    assert (official.decoder_dim, official.asr_res_dim) == (1024, 64)  # what the package hard-codes
    raw = _raw()
    raw.update(hidden_dim=64, decoder_dim=128, asr_res_dim=16)
    raw["istftnet"]["upsample_initial_channel"] = 32
    small = KokoroConfig.from_dict(raw)
    assert (small.hidden_dim, small.decoder_dim, small.asr_res_dim) == (64, 128, 16)
    assert small.to_dict() == raw
    assert list(small.to_dict())[-2:] == ["decoder_dim", "asr_res_dim"]  # after the official fields


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        KokoroConfig.official().n_token = 3  # type: ignore[misc]


def _raw():
    return json.loads(OFFICIAL_CONFIG.read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda r: r.pop("n_token"), "missing field 'n_token'"),
        (lambda r: r["plbert"].pop("hidden_size"), "missing field 'hidden_size'"),
        (lambda r: r.update(decoder_dim=0), "decoder_dim must be a positive integer"),
        (lambda r: r.update(asr_res_dim=True), "asr_res_dim must be a positive integer"),
        (lambda r: r["istftnet"].update(upsample_initial_channel=66), "must halve at every upsampling stage"),
        (lambda r: r.update(n_layer=0), "n_layer must be a positive integer"),
        (lambda r: r.update(text_encoder_kernel_size=4), "must be odd"),
        (lambda r: r["plbert"].update(num_attention_heads=7), "multiple of plbert.num_attention_heads"),
        (lambda r: r["istftnet"].update(upsample_rates=[10]), "of one length"),
        (lambda r: r["istftnet"].update(gen_istft_n_fft=21), "must be even"),
        (lambda r: r["vocab"].update(x=178), "vocab ids must be integers in"),
        (lambda r: r["vocab"].update(ab=3), "single characters"),
    ],
)
def test_bad_config_names_the_field(edit, message):
    raw = _raw()
    edit(raw)
    with pytest.raises(ConfigError, match=message):
        KokoroConfig.from_dict(raw)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        KokoroConfig.from_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        KokoroConfig.from_file(tmp_path / "config.json")
