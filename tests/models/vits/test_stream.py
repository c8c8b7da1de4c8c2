"""Chunked decoding: pieces of the decoder's output, each decoded from a window that reaches the receptive
field past its ends, joined equal the one-shot waveform (within float rounding of other conv shapes)."""

from __future__ import annotations

import pytest
import torch

from chattts_serve.models.vits.config import VitsConfig
from chattts_serve.models.vits.decoder import receptive_field
from chattts_serve.models.vits.model import Utterance

# Measured: joins differ from the one-shot waveform by 1.5e-8 (tiny checkpoint, 3-frame chunks) and 1.8e-7
# (MMS-size random checkpoint, 32-frame chunks): other conv shapes, other kernel blockings.
JOIN_BOUND = 1e-6


@pytest.fixture(scope="module")
def latent(vits_model, vits_tokenizer):
    ids = vits_tokenizer.encode("the quick brown fox jumps over the lazy dog, twice over")
    lat = vits_model.latent(Utterance(ids, generator=torch.Generator().manual_seed(4)))
    one_shot = vits_model.decode_latents([lat])[0]
    return lat, vits_model.flow_latent(lat), one_shot


@pytest.mark.parametrize("chunk", [1, 3, 7, 16, 1000])
def test_chunks_join_to_the_one_shot_waveform(vits_model, latent, chunk):
    lat, z, one_shot = latent
    with torch.inference_mode():
        pieces = list(vits_model.decoder.decode_chunks(z, chunk))
    hop = vits_model.config.samples_per_frame
    assert all(p.shape[0] == min(chunk, z.shape[-1] - i * chunk) * hop for i, p in enumerate(pieces))
    joined = torch.cat(pieces)
    assert joined.shape == one_shot.shape
    assert float((joined - one_shot).abs().max()) <= JOIN_BOUND


def test_a_window_short_of_the_receptive_field_is_not_enough(vits_model, latent):
    """The overlap is needed: with one frame less of context on each side the join is visibly wrong."""
    lat, z, one_shot = latent
    decoder = vits_model.decoder
    field = decoder.receptive_field
    hop = vits_model.config.samples_per_frame
    start, end = 10, 14
    assert z.shape[-1] > end + field
    with torch.inference_mode():
        short = decoder.forward(z[..., start - 1 : end + 1], _lengths(end - start + 2))[0][hop : -hop]
        full = decoder.decode_range(z, start, end)
    expected = one_shot[start * hop : end * hop]
    assert float((full - expected).abs().max()) <= JOIN_BOUND
    assert float((short - expected).abs().max()) > 100 * JOIN_BOUND


def test_receptive_field_of_the_mms_decoder():
    # MMS-TTS: conv_pre 3 frames; per stage ceil(k/r) input frames of the transposed conv, and the widest
    # resblock (k=11, d=1,3,5: 60 samples) at the stage's rate: 3 + (2 + 7.5) + (0.25 + 0.94) + ... = 14.4.
    assert receptive_field(VitsConfig()) == 15


def test_decode_range_checks_its_range(vits_model, latent):
    _, z, _ = latent
    with pytest.raises(ValueError, match="frame range"):
        vits_model.decoder.decode_range(z, 5, 5)
    with pytest.raises(ValueError, match="frame range"):
        vits_model.decoder.decode_range(z, 0, z.shape[-1] + 1)
    with pytest.raises(ValueError, match="chunk_frames"):
        list(vits_model.decoder.decode_chunks(z, 0))


def _lengths(n: int):
    from chattts_serve.models.vits.masks import Lengths

    return Lengths([n])


@pytest.mark.parametrize("chunk", [1, 8, 10_000])
def test_model_stream_equals_synthesize(vits_model, vits_tokenizer, chunk):
    ids = vits_tokenizer.encode("streaming before the whole utterance is decoded")
    whole = vits_model.synthesize([Utterance(ids, generator=torch.Generator().manual_seed(8))])[0]
    durations, pieces = vits_model.stream(Utterance(ids, generator=torch.Generator().manual_seed(8)), chunk)
    assert torch.equal(durations, whole.durations)
    joined = torch.cat(list(pieces))
    assert joined.shape == whole.audio.shape
    assert float((joined - whole.audio).abs().max()) <= JOIN_BOUND


def test_model_stream_with_a_speaker(tmp_path, vits_tokenizer):
    from chattts_serve.models.vits.checkpoint import load
    from chattts_serve.models.vits.random_checkpoint import write_random

    model = load(write_random(tmp_path / "ckpt", "tiny", seed=3, num_speakers=2, speaker_embedding_size=4))
    ids = vits_tokenizer.encode("two voices")
    whole = model.synthesize([Utterance(ids, speaker_id=1, generator=torch.Generator().manual_seed(1))])[0]
    _, pieces = model.stream(Utterance(ids, speaker_id=1, generator=torch.Generator().manual_seed(1)), 4)
    assert float((torch.cat(list(pieces)) - whole.audio).abs().max()) <= JOIN_BOUND
