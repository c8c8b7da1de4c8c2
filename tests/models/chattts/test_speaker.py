"""Speaker / prompt-code strings against goldens recorded from ``chattts==0.2.5``.

The golden file is produced by ``scripts/golden_speaker.py`` run with the reference interpreter.
"""

from __future__ import annotations

import json
import lzma
from pathlib import Path

import numpy as np
import pybase16384 as b14
import pytest
import torch

from chattts_serve.models.chattts.speaker import (
    DEFAULT_SPEAKER_STATS_STRING,
    SpeakerStats,
    blend_speakers,
    decode_prompt_codes,
    decode_speaker,
    default_speaker_stats,
    encode_prompt_codes,
    encode_speaker,
    normalized_speaker_embedding,
)

GOLDEN = json.loads(Path(__file__).with_name("golden_speaker.json").read_text(encoding="utf-8"))
_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]


def f16(hex_str: str) -> np.ndarray:
    return np.frombuffer(bytes.fromhex(hex_str), dtype="<f2").astype(np.float16)


def raw_speaker_string(payload: bytes) -> str:
    return b14.encode_to_string(lzma.compress(payload, format=lzma.FORMAT_RAW, filters=_FILTERS))


# ---------------------------------------------------------------- statistics


def test_default_stats_match_reference():
    assert DEFAULT_SPEAKER_STATS_STRING == GOLDEN["spk_stat"]
    stats = default_speaker_stats()
    assert stats.dim == 768
    assert stats.std.dtype == stats.mean.dtype == torch.float16
    assert stats.to_string() == GOLDEN["spk_stat"]
    assert default_speaker_stats() is stats


@pytest.mark.parametrize("case", GOLDEN["samples"], ids=lambda c: f"seed{c['seed']}")
def test_sample_matches_reference_seed(case):
    stats = default_speaker_stats()
    torch.manual_seed(case["seed"])
    emb = stats.sample()
    assert emb.dtype == torch.float16 and emb.shape == (768,)
    np.testing.assert_array_equal(emb.numpy().view(np.uint16), f16(case["f16_hex"]).view(np.uint16))
    # ... and our encoder produces the reference's exact string for it.
    assert encode_speaker(emb) == case["string"]


def test_sample_with_generator_matches_global_rng():
    stats = default_speaker_stats()
    torch.manual_seed(42)
    a = stats.sample()
    b = stats.sample(torch.Generator().manual_seed(42))
    assert torch.equal(a, b)


def test_stats_string_round_trip_and_errors():
    stats = SpeakerStats.from_string(DEFAULT_SPEAKER_STATS_STRING)
    assert torch.equal(stats.std, default_speaker_stats().std)
    small = SpeakerStats(std=torch.ones(3, dtype=torch.float16), mean=torch.zeros(3, dtype=torch.float16))
    back = SpeakerStats.from_string(small.to_string())
    assert torch.equal(back.std, small.std) and torch.equal(back.mean, small.mean)
    with pytest.raises(ValueError):
        SpeakerStats.from_string(b14.encode_to_string(b"\x00\x3c" * 3))  # 3 values: not 2 * D
    with pytest.raises(ValueError):
        SpeakerStats.from_string("")
    with pytest.raises(ValueError):
        SpeakerStats(std=torch.ones(3), mean=torch.zeros(3))  # float32


# ---------------------------------------------------------------- speaker strings


@pytest.mark.parametrize("case", GOLDEN["samples"], ids=lambda c: f"seed{c['seed']}")
def test_decode_reference_sample_strings(case):
    got = decode_speaker(case["string"], expected_dim=768)
    assert got.dtype == np.float16 and got.ndim == 1 and got.flags.writeable
    np.testing.assert_array_equal(got.view(np.uint16), f16(case["f16_hex"]).view(np.uint16))


@pytest.mark.parametrize("case", GOLDEN["encoded"], ids=lambda c: c["name"])
def test_encode_matches_reference_encode(case):
    values = f16(case["f16_hex"])
    assert encode_speaker(values) == case["string"]
    assert encode_speaker(torch.from_numpy(values.copy())) == case["string"]
    np.testing.assert_array_equal(decode_speaker(case["string"]).view(np.uint16), values.view(np.uint16))


def test_encode_casts_float32_like_reference():
    case = next(c for c in GOLDEN["encoded"] if c["name"] == "float32_rounding")
    src = torch.tensor([0.1, 0.2, 0.3, 1 / 3, 1e-5, -7.77777])
    assert encode_speaker(src) == case["string"]
    assert encode_speaker(src.numpy()) == case["string"]


def test_round_trip_random():
    g = torch.Generator().manual_seed(3)
    for dim in (1, 7, 768, 1024):
        emb = torch.randn(dim, generator=g).half()
        back = decode_speaker(encode_speaker(emb))
        assert torch.equal(torch.from_numpy(back), emb)


@pytest.mark.parametrize("case", GOLDEN["samples"], ids=lambda c: f"seed{c['seed']}")
def test_normalized_embedding_matches_reference(case):
    emb = torch.from_numpy(decode_speaker(case["string"]))
    got = normalized_speaker_embedding(emb)
    assert got.dtype == torch.float16 and got.device.type == "cpu"
    np.testing.assert_array_equal(got.numpy().view(np.uint16), f16(case["normalized_f16_hex"]).view(np.uint16))


BAD_SPEAKER_INPUTS = [
    pytest.param("", id="empty"),
    pytest.param("   \n", id="whitespace"),
    pytest.param("hello world", id="ascii-garbage"),
    pytest.param("愐穤", id="short-b14"),
    pytest.param("㴆", id="b14-marker-only"),
    pytest.param("😀😀", id="emoji"),
    pytest.param("\ud800", id="lone-surrogate"),
    pytest.param(b14.encode_to_string(b"\x01\x02\x03\x04"), id="not-lzma"),
    pytest.param(raw_speaker_string(b""), id="empty-payload"),
    pytest.param(raw_speaker_string(b"\x00\x3c\x00"), id="odd-bytes"),
    pytest.param(raw_speaker_string(np.array([1, np.inf], "<f2").tobytes()), id="inf"),
    pytest.param(raw_speaker_string(np.array([np.nan, 1], "<f2").tobytes()), id="nan"),
    pytest.param(None, id="None"),
    pytest.param(b"\x00\x01", id="bytes"),
    pytest.param(123, id="int"),
]


@pytest.mark.parametrize("bad", BAD_SPEAKER_INPUTS)
def test_decode_speaker_rejects_garbage(bad):
    with pytest.raises(ValueError):
        decode_speaker(bad)


def test_decode_speaker_rejects_truncated_and_bombs():
    good = GOLDEN["samples"][0]["string"]
    with pytest.raises(ValueError):
        decode_speaker(good[: len(good) // 2])
    with pytest.raises(ValueError, match="larger"):
        decode_speaker(raw_speaker_string(bytes(4 << 20)))


def test_decode_speaker_expected_dim():
    s = GOLDEN["samples"][0]["string"]
    assert decode_speaker(s, expected_dim=768).shape == (768,)
    with pytest.raises(ValueError, match="dimension 768, expected 1024"):
        decode_speaker(s, expected_dim=1024)
    assert decode_speaker("  " + s + "\n").shape == (768,)  # surrounding whitespace tolerated


def test_encode_speaker_rejects_bad_input():
    for bad in (torch.zeros(2, 3), torch.zeros(0), torch.tensor([1.0, float("nan")]), [1e6], "abc"):
        with pytest.raises(ValueError):
            encode_speaker(bad)


# ---------------------------------------------------------------- prompt codes


@pytest.mark.parametrize("case", GOLDEN["prompts"], ids=lambda c: c["name"])
def test_prompt_codes_match_reference(case):
    codes = np.frombuffer(bytes.fromhex(case["codes_u16_hex"]), dtype="<u2").reshape(case["shape"])
    expected = torch.from_numpy(codes.astype(np.int64))
    assert encode_prompt_codes(expected) == case["string"]
    assert encode_prompt_codes(codes.astype(np.int32)) == case["string"]
    got = decode_prompt_codes(case["string"])
    assert got.dtype == torch.int32 and list(got.shape) == case["shape"]
    assert torch.equal(got.long(), expected)


@pytest.mark.parametrize("shape", [(768,), (4, 1), (4, 300), (4, 3000)])
def test_encoder_dictionary_sized_to_the_input_writes_the_presets_bytes(shape):
    """The encoder sizes its dictionary to the payload (the preset's 64 MiB one costs ~50 ms to set up): the
    bytes must stay those of the reference's filters, for embeddings and prompt codes of every length."""
    rng = np.random.default_rng(len(shape) * 10_000 + shape[-1])
    for _ in range(5):
        if len(shape) == 1:
            payload = rng.standard_normal(shape).astype("<f2").tobytes()
            got = encode_speaker(np.frombuffer(payload, dtype="<f2"))
        else:
            codes = np.repeat(rng.integers(0, 626, (shape[0], max(1, shape[1] // 4))), 4, axis=1)[:, : shape[1]]
            payload = np.ascontiguousarray(codes, dtype="<u2").tobytes()
            got = encode_prompt_codes(codes)
        full = lzma.compress(payload, format=lzma.FORMAT_RAW, filters=_FILTERS)
        header = b"" if len(shape) == 1 else np.array(codes.shape, dtype="<u2").tobytes()
        assert got == b14.encode_to_string(header + full)


def test_prompt_codes_bad_input():
    good = GOLDEN["prompts"][0]["string"]
    bad_strings = [
        "",
        "garbage",
        None,
        b14.encode_to_string(b"\x04\x00"),  # header too short
        b14.encode_to_string(b"\x04\x00\x02\x00" + b"\x01\x02\x03"),  # not lzma
        good[: len(good) // 2],  # truncated
    ]
    # header / payload size mismatch
    raw = b14.decode_from_string(good)
    bad_strings.append(b14.encode_to_string(b"\x04\x00\x05\x00" + raw[4:]))
    bad_strings.append(b14.encode_to_string(b"\xff\xff\xff\xff" + raw[4:]))
    for bad in bad_strings:
        with pytest.raises(ValueError):
            decode_prompt_codes(bad)
    for bad_codes in (torch.zeros(3), torch.zeros(2, 2, 2), torch.tensor([[-1, 2]]), torch.tensor([[70000]])):
        with pytest.raises(ValueError):
            encode_prompt_codes(bad_codes)
    with pytest.raises(ValueError):
        encode_prompt_codes(torch.zeros(2, 2, dtype=torch.float32))


# ---------------------------------------------------------------- blending


def sampled(seed: int) -> np.ndarray:
    return default_speaker_stats().sample(torch.Generator().manual_seed(seed)).numpy()


def z_of(emb: np.ndarray) -> np.ndarray:
    stats = default_speaker_stats()
    return (emb.astype(np.float64) - stats.mean.double().numpy()) / stats.std.double().numpy()


def cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_blend_of_a_voice_with_itself_is_that_voice():
    a, stats = sampled(1), default_speaker_stats()
    assert blend_speakers([a], [3.0], stats).dtype == np.float16
    assert np.array_equal(blend_speakers([a], [3.0], stats), a)
    assert np.array_equal(blend_speakers([a, a], [2.0, 1.0], stats), a)
    assert np.array_equal(blend_speakers([a, a, a], [0.1, 5.0, 1.0], None), a)


def test_blend_weights_are_normalised():
    a, b, stats = sampled(1), sampled(2), default_speaker_stats()
    mix = blend_speakers([a, b], [2.0, 1.0], stats)
    assert np.array_equal(mix, blend_speakers([a, b], [4.0, 2.0], stats))
    assert np.array_equal(mix, blend_speakers([a, b], [2e300, 1e300], stats))  # no overflow in the sum
    assert np.array_equal(blend_speakers([a, b], [1.0, 1.0], stats), blend_speakers([b, a], [0.5, 0.5], stats))


def test_blend_lies_between_its_voices_in_the_sampled_space():
    a, b = sampled(1), sampled(2)
    za, zb = z_of(a), z_of(b)
    z = z_of(blend_speakers([a, b], [2.0, 1.0], default_speaker_stats()))
    # a positive combination of the two, in the weights' ratio (up to float16 rounding) ...
    (ca, cb), *_ = np.linalg.lstsq(np.stack([za, zb], axis=1), z, rcond=None)
    assert ca > 0 and cb > 0 and ca / cb == pytest.approx(2.0, rel=0.01)
    # ... so nearer the heavier voice, and nearer each voice than they are to each other
    assert cos(z, za) > cos(z, zb) > cos(za, zb)
    # with the norm of its parts (weighted): as typical a speaker as the sampler draws
    assert np.linalg.norm(z) == pytest.approx((2 * np.linalg.norm(za) + np.linalg.norm(zb)) / 3, rel=0.01)


def test_blend_stays_as_far_from_the_mean_speaker_as_its_parts():
    """A plain mean of two voices drifts toward the checkpoint's mean speaker (what the model sees after its
    L2 normalisation); the blend does not."""
    stats = default_speaker_stats()
    mean = stats.mean.double().numpy()
    a, b = sampled(1), sampled(2)
    plain = (a.astype(np.float64) + b) / 2
    mix = blend_speakers([a, b], [1.0, 1.0], stats).astype(np.float64)
    parts = max(cos(a.astype(np.float64), mean), cos(b.astype(np.float64), mean))
    assert cos(plain, mean) > parts + 0.05
    assert cos(mix, mean) < parts + 0.02


def test_blend_refuses_bad_input():
    a = sampled(1)
    for weights in ([0.0, 1.0], [-1.0, 1.0], [float("nan"), 1.0], [float("inf"), 1.0], [1.0]):
        with pytest.raises(ValueError):
            blend_speakers([a, a], weights, default_speaker_stats())
    with pytest.raises(ValueError):
        blend_speakers([], [], None)
    with pytest.raises(ValueError):
        blend_speakers([a, a[:10]], [1.0, 1.0], None)  # different dimensions
    with pytest.raises(ValueError):
        blend_speakers([a[:10], a[:10]], [1.0, 1.0], default_speaker_stats())  # not the statistics' dimension
