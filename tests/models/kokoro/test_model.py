"""KokoroModel: batching across utterances, each row equal to itself alone, and input checks."""

from __future__ import annotations

import pytest
import torch

from chattts_serve.models.kokoro.model import Utterance
from chattts_serve.models.kokoro.voices import load_voice, style_for

VOICES = ("af_heart", "af_bella", "af_sky", "zf_xiaobei", "zm_yunjian")
LENGTHS = (5, 13, 19, 9, 3, 16, 7, 11)  # phonemes, boundaries not counted
SPEEDS = (1.0, 1.2, 0.8)
# The decoder runs over the padded batch: its convolutions take other kernels than at batch 1, so a row
# moves by float rounding only. Measured, batches of 2-8 of 3-100 phonemes, tiny and full-size random
# checkpoints: max |diff| <= 3e-7 on waveforms peaking ~0.4 (durations, F0 and energy exact). A batched
# sine source once gave 1e-5 here (tiny) and 3e-2 (full): the STFT's phases jump on a 1-ulp change.
AUDIO_BOUND = 2e-6


def _utterances(root, n: int, seed0: int = 100) -> list[dict]:
    gen = torch.Generator().manual_seed(seed0)
    out = []
    for i, length in enumerate(LENGTHS[:n]):
        ids = [0, *torch.randint(1, 178, (length,), generator=gen).tolist(), 0]
        pack = load_voice(root, VOICES[i % len(VOICES)])
        out.append({"ids": ids, "style": style_for(pack, length), "speed": SPEEDS[i % 3], "seed": seed0 + i})
    return out


def _make(u: dict) -> Utterance:
    return Utterance(u["ids"], u["style"], u["speed"], torch.Generator().manual_seed(u["seed"]))


@pytest.fixture(scope="module")
def alone(kokoro_model, kokoro_tiny):
    utts = _utterances(kokoro_tiny, len(LENGTHS))
    return utts, [kokoro_model.synthesize([_make(u)])[0] for u in utts]


@pytest.mark.parametrize("batch", [2, 3, 8])
def test_every_row_of_a_batch_is_its_batch1_result(kokoro_model, alone, batch):
    utts, singles = alone
    rows = kokoro_model.synthesize([_make(u) for u in utts[:batch]])
    assert len(rows) == batch
    for row, single in zip(rows, singles, strict=False):
        assert torch.equal(row.durations, single.durations)
        assert torch.equal(row.f0, single.f0) and torch.equal(row.energy, single.energy)
        assert row.audio.shape == single.audio.shape
        assert (row.audio - single.audio).abs().max().item() <= AUDIO_BOUND


def test_one_forward_text_side_keeps_durations(kokoro_model, alone):
    """prosody='batch' runs ALBERT and the LSTMs over the padded batch too: durations stay exact, the
    curves move by rounding only (the waveform then drifts through the sine phase; not checked here)."""
    utts, singles = alone
    rows = kokoro_model.synthesize([_make(u) for u in utts[:4]], prosody="batch")
    for row, single in zip(rows, singles[:4], strict=True):
        assert torch.equal(row.durations, single.durations)
        assert torch.allclose(row.f0, single.f0, rtol=1e-5, atol=1e-3)
        assert row.audio.shape == single.audio.shape


def test_audio_length_follows_the_durations(kokoro_model, alone):
    _, singles = alone
    for s in singles:
        assert s.audio.dtype == torch.float32 and s.audio.dim() == 1
        assert s.audio.shape[0] == int(s.durations.sum()) * s.samples_per_frame
        assert s.f0.shape[0] == 2 * int(s.durations.sum())
        assert int(s.durations.min()) >= 1


def test_seed_repeats_and_global_generator_is_the_default(kokoro_model, kokoro_tiny):
    u = _utterances(kokoro_tiny, 1)[0]
    a = kokoro_model.synthesize([_make(u)])[0].audio
    b = kokoro_model.synthesize([_make(u)])[0].audio
    assert torch.equal(a, b)
    torch.manual_seed(u["seed"])
    c = kokoro_model.synthesize([Utterance(u["ids"], u["style"], u["speed"], None)])[0].audio
    assert torch.equal(a, c)
    other = kokoro_model.synthesize([Utterance(u["ids"], u["style"], u["speed"],
                                               torch.Generator().manual_seed(u["seed"] + 1))])[0].audio
    assert not torch.equal(a, other)


def test_speed_shortens(kokoro_model, kokoro_tiny):
    u = _utterances(kokoro_tiny, 3)[2]
    slow = kokoro_model.synthesize([Utterance(u["ids"], u["style"], 0.5)])[0]
    fast = kokoro_model.synthesize([Utterance(u["ids"], u["style"], 2.0)])[0]
    assert int(slow.durations.sum()) > int(fast.durations.sum())


@pytest.mark.parametrize(
    ("ids", "style", "speed", "message"),
    [
        ([0, 0], None, 1.0, "at least one phoneme"),
        ([0, 5, 178, 0], None, 1.0, "must lie in"),
        ([0, 5, 0], torch.zeros(1, 128), 1.0, "style must hold 256"),
        ([0, 5, 0], None, 0.0, "speed must be positive"),
        ([0, *([5] * 511), 0], None, 1.0, "exceed the model's context of 512"),
    ],
)
def test_bad_input_is_a_clear_error(kokoro_model, ids, style, speed, message):
    style = torch.zeros(1, 256) if style is None else style
    with pytest.raises(ValueError, match=message):
        kokoro_model.synthesize([Utterance(ids, style, speed)])


def test_empty_batch_and_bad_prosody_mode(kokoro_model):
    assert kokoro_model.synthesize([]) == []
    with pytest.raises(ValueError, match="prosody"):
        kokoro_model.synthesize([Utterance([0, 5, 0], torch.zeros(256))], prosody="fast")


def test_a_bf16_decoder_keeps_the_fp32_text_side_exactly(kokoro_tiny, alone):
    """``cast_decoder(bf16)`` (``--audio-dtype bf16``): durations and F0/energy are the fp32 ones bit for bit (the
    text side stays fp32), the sine source and the spectra stay fp32, the waveform moves (its cost is measured in
    docs/kokoro.md), and a row is still its batch-1 result where rows run alone."""
    from chattts_serve.models.kokoro.checkpoint import load

    model = load(kokoro_tiny).cast_decoder(torch.bfloat16)
    assert model.decoder_dtype == torch.bfloat16 and model.bert_encoder.weight.dtype == torch.float32
    assert model.decoder.generator.m_source.l_linear.weight.dtype == torch.float32
    assert model.decoder.generator.window.dtype == torch.float32
    utts, singles = alone
    for u, single in zip(utts[:3], singles, strict=False):
        out = model.synthesize([_make(u)])[0]
        assert torch.equal(out.durations, single.durations)
        assert torch.equal(out.f0, single.f0) and torch.equal(out.energy, single.energy)
        assert out.audio.dtype == torch.float32 and out.audio.shape == single.audio.shape
        assert torch.isfinite(out.audio).all() and not torch.equal(out.audio, single.audio)
        assert torch.equal(model.synthesize([_make(u)])[0].audio, out.audio)  # deterministic


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_compiled_decoder_is_close_to_eager_and_pads_eagerly(kokoro_tiny, alone):
    """``compile_decoder`` (``--compile``): AdaIN + snake compiled into one pass; durations exact, the waveform
    close to the eager one (not its bits), and a padded batch still runs (the eager path)."""
    from chattts_serve.models.kokoro.checkpoint import load

    model = load(kokoro_tiny).compile_decoder()
    assert all(b.fused is not None for b in model.decoder.generator.resblocks)
    utts, singles = alone
    for u, single in zip(utts[:2], singles, strict=False):
        out = model.synthesize([_make(u)])[0]
        assert torch.equal(out.durations, single.durations)
        noise = ((out.audio - single.audio) ** 2).sum() / (single.audio**2).sum()
        assert 0 < noise < 1e-8  # > 80 dB SNR in fp32; measured ~125 dB on the full-size checkpoint
    padded = model.synthesize([_make(u) for u in utts[:3]])
    for row, single in zip(padded, singles, strict=False):
        assert torch.equal(row.durations, single.durations)
        assert (row.audio - single.audio).abs().max().item() <= AUDIO_BOUND
