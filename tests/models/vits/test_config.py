"""VitsConfig: read as transformers reads config.json, validated with errors that name the field."""

from __future__ import annotations

import json

import pytest

from chattts_serve.models.vits.config import ConfigError, VitsConfig


def _raw(**changes):
    raw = {"model_type": "vits", **VitsConfig().to_dict()}
    raw.update(changes)
    return raw


def test_defaults_are_transformers_and_mms_sizes():
    c = VitsConfig.from_dict({"model_type": "vits"})
    assert c == VitsConfig()
    assert (c.hidden_size, c.flow_size, c.sampling_rate, c.samples_per_frame) == (192, 192, 16000, 256)
    assert c.resblock_dilation_sizes == ((1, 3, 5),) * 3


def test_round_trip_and_lists_become_tuples(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_raw(upsample_rates=[4, 4], upsample_kernel_sizes=[8, 8], architectures=["VitsModel"],
                                    transformers_version="4.33.0.dev0")))
    c = VitsConfig.from_file(path)
    assert c.upsample_rates == (4, 4) and c.samples_per_frame == 16
    assert VitsConfig.from_dict({"model_type": "vits", **c.to_dict()}) == c
    hash(c)  # frozen, hashable


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_type": "bert"}, "model_type is 'bert', expected 'vits'"),
        ({"hidden_size": 0}, "hidden_size must be an integer >= 1"),
        ({"hidden_size": 192.0}, "hidden_size must be an integer"),
        ({"num_attention_heads": 5}, "divisible by num_attention_heads"),
        ({"flow_size": 191}, "flow_size must be even"),
        ({"upsample_rates": [8, 8, 2]}, "must be non-empty and of one length"),
        ({"upsample_rates": [8, "8", 2, 2]}, "upsample_rates must be a list of integers"),
        ({"upsample_kernel_sizes": [15, 16, 4, 4]}, "each upsample kernel size"),
        ({"resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5]]}, "resblock_kernel_sizes and resblock_dilation_sizes"),
        ({"resblock_kernel_sizes": [3, 7, 10]}, "resblock_kernel_sizes must be odd"),
        ({"num_speakers": 4, "speaker_embedding_size": 0}, "speaker_embedding_size > 0"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"depth_separable_channels": 4}, "depth_separable_channels must be 2"),
        ({"speaking_rate": 0}, "speaking_rate must be positive"),
        ({"noise_scale": "loud"}, "noise_scale must be a number"),
        ({"window_size": 0}, "window_size must be a positive integer or null"),
    ],
)
def test_bad_fields_are_named(changes, message):
    with pytest.raises(ConfigError, match=message):
        VitsConfig.from_dict(_raw(**changes))


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        VitsConfig.from_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        VitsConfig.from_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a JSON object"):
        VitsConfig.from_file(tmp_path / "config.json")
