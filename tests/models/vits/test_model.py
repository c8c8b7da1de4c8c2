"""VitsModel.synthesize: batch invariance, per-utterance noise, options, and clear errors."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from chattts_serve.models.vits.checkpoint import load
from chattts_serve.models.vits.model import Utterance, decode_groups
from chattts_serve.models.vits.random_checkpoint import write_random

# Measured on the tiny checkpoint (fp32, 1 thread): batched rows differ from themselves alone by <= 4e-8 (the
# flow's and decoder's convolutions pick other blockings for other shapes); the bound leaves headroom. Without
# the decoder's masks a padded row differs by ~0.02 (measured), so the test sees a missing mask.
BATCH_BOUND = 1e-5

SENTENCES = [
    "hello world", "a", "the quick brown fox jumps over the lazy dog", "kick", "it's four o'clock",
    "one two three four five six seven eight nine ten", "yes", "mixed-length batches, padded and masked",
]


def _utterances(tokenizer, n: int, seed: int = 0) -> list[Utterance]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        out.append(Utterance(tokenizer.encode(SENTENCES[i % len(SENTENCES)]),
                             speaking_rate=rng.choice([0.8, 1.0, 1.25]), noise_scale=rng.choice([0.0, 0.667, 1.0]),
                             noise_scale_duration=rng.choice([0.0, 0.8]),
                             generator=torch.Generator().manual_seed(100 + i)))
    return out


def _fresh(utt: Utterance, seed: int) -> Utterance:
    return Utterance(utt.input_ids, utt.speaking_rate, utt.noise_scale, utt.noise_scale_duration,
                     torch.Generator().manual_seed(seed), utt.speaker_id)


@pytest.fixture(params=["cpu-default", "one-padded-batch"])
def decoding(request, vits_model):
    """Each batch test twice: the CPU's default (row by row) and every row in one padded batch (the path
    accelerators take, forced here: all masks exercised on maximally ragged rows)."""
    saved = vits_model.batch_decoder, vits_model.max_padding
    if request.param == "one-padded-batch":
        vits_model.batch_decoder, vits_model.max_padding = True, float("inf")
    yield request.param
    vits_model.batch_decoder, vits_model.max_padding = saved


@pytest.mark.parametrize("size", [1, 2, 3, 8])
def test_every_row_equals_itself_alone(vits_model, vits_tokenizer, size, decoding):
    batch = _utterances(vits_tokenizer, size, seed=size)
    together = vits_model.synthesize([_fresh(u, 100 + i) for i, u in enumerate(batch)])
    for i, utt in enumerate(batch):
        alone = vits_model.synthesize([_fresh(utt, 100 + i)])[0]
        np.testing.assert_array_equal(together[i].durations.numpy(), alone.durations.numpy())
        assert together[i].audio.shape == alone.audio.shape
        assert float((together[i].audio - alone.audio).abs().max()) <= BATCH_BOUND


def test_a_row_does_not_depend_on_its_neighbours(vits_model, vits_tokenizer, decoding):
    """The same utterance next to different neighbours: the same durations, the same audio within the bound."""
    target = _utterances(vits_tokenizer, 1)[0]
    short = Utterance(vits_tokenizer.encode("a"), generator=torch.Generator().manual_seed(1))
    long = Utterance(vits_tokenizer.encode(" ".join(SENTENCES)), generator=torch.Generator().manual_seed(2))
    a = vits_model.synthesize([_fresh(target, 5), short])[0]
    b = vits_model.synthesize([long, _fresh(target, 5)])[1]
    np.testing.assert_array_equal(a.durations.numpy(), b.durations.numpy())
    assert float((a.audio - b.audio).abs().max()) <= BATCH_BOUND


def test_generator_makes_it_repeatable_and_seeds_differ(vits_model, vits_tokenizer):
    ids = vits_tokenizer.encode("hello world")
    one = vits_model.synthesize([Utterance(ids, generator=torch.Generator().manual_seed(3))])[0]
    two = vits_model.synthesize([Utterance(ids, generator=torch.Generator().manual_seed(3))])[0]
    other = vits_model.synthesize([Utterance(ids, generator=torch.Generator().manual_seed(4))])[0]
    assert torch.equal(one.audio, two.audio)
    assert one.audio.shape != other.audio.shape or not torch.equal(one.audio, other.audio)


def test_output_shapes_and_durations(vits_model, vits_tokenizer):
    ids = vits_tokenizer.encode("hello world")
    syn = vits_model.synthesize([Utterance(ids, generator=torch.Generator().manual_seed(0))])[0]
    assert syn.durations.dtype == torch.int64 and syn.durations.shape == (len(ids),)
    assert syn.samples_per_frame == vits_model.config.samples_per_frame
    assert syn.audio.dtype == torch.float32
    assert syn.audio.shape == (int(syn.durations.sum()) * syn.samples_per_frame,)
    assert float(syn.audio.abs().max()) <= 1.0


def test_speaking_rate_shortens(vits_model, vits_tokenizer):
    ids = vits_tokenizer.encode("the quick brown fox jumps over the lazy dog")
    slow = vits_model.synthesize([Utterance(ids, speaking_rate=0.5, generator=torch.Generator().manual_seed(0))])[0]
    fast = vits_model.synthesize([Utterance(ids, speaking_rate=2.0, generator=torch.Generator().manual_seed(0))])[0]
    assert int(fast.durations.sum()) < int(slow.durations.sum())


def test_defaults_come_from_the_config(vits_model, vits_tokenizer):
    c = vits_model.config
    ids = vits_tokenizer.encode("hello")
    implicit = vits_model.synthesize([Utterance(ids, generator=torch.Generator().manual_seed(9))])[0]
    explicit = vits_model.synthesize([Utterance(ids, c.speaking_rate, c.noise_scale, c.noise_scale_duration,
                                                torch.Generator().manual_seed(9))])[0]
    assert torch.equal(implicit.audio, explicit.audio)


def test_empty_batch(vits_model):
    assert vits_model.synthesize([]) == []


@pytest.mark.parametrize(
    ("utt", "message"),
    [
        (Utterance([]), "input_ids is empty"),
        (Utterance([0, 38, 0]), "outside the vocabulary"),
        (Utterance([0, -1, 0]), "outside the vocabulary"),
        (Utterance([0, 6, 0], speaking_rate=0.0), "speaking_rate"),
        (Utterance([0, 6, 0], speaking_rate=float("nan")), "speaking_rate"),
        (Utterance([0, 6, 0], noise_scale=-1.0), "noise_scale"),
        (Utterance([0, 6, 0], noise_scale_duration=float("inf")), "noise_scale_duration"),
        (Utterance([0, 6, 0], speaker_id=2), "one speaker"),
    ],
)
def test_bad_utterances_are_clear_errors(vits_model, utt, message):
    with pytest.raises(ValueError, match=message):
        vits_model.synthesize([utt])


@pytest.fixture(scope="module")
def multi_speaker(tmp_path_factory):
    root = write_random(tmp_path_factory.mktemp("vits-ms") / "ckpt", "tiny", seed=1, num_speakers=3,
                        speaker_embedding_size=8)
    return load(root)


def test_multi_speaker_batch_invariance_and_voices_differ(multi_speaker, vits_tokenizer):
    multi_speaker.batch_decoder, multi_speaker.max_padding = True, float("inf")
    ids = [vits_tokenizer.encode(s) for s in SENTENCES[:3]]
    batch = [Utterance(i, speaker_id=s, generator=torch.Generator().manual_seed(s)) for s, i in enumerate(ids)]
    together = multi_speaker.synthesize(batch)
    for s, i in enumerate(ids):
        alone = multi_speaker.synthesize([Utterance(i, speaker_id=s, generator=torch.Generator().manual_seed(s))])[0]
        np.testing.assert_array_equal(together[s].durations.numpy(), alone.durations.numpy())
        assert float((together[s].audio - alone.audio).abs().max()) <= BATCH_BOUND
    a = multi_speaker.synthesize([Utterance(ids[0], speaker_id=0, generator=torch.Generator().manual_seed(0))])[0]
    b = multi_speaker.synthesize([Utterance(ids[0], speaker_id=1, generator=torch.Generator().manual_seed(0))])[0]
    assert a.audio.shape != b.audio.shape or not torch.equal(a.audio, b.audio)


def test_multi_speaker_errors(multi_speaker):
    with pytest.raises(ValueError, match=r"speaker_id must be in \[0, 2\]"):
        multi_speaker.synthesize([Utterance([0, 6, 0], speaker_id=3)])
    with pytest.raises(ValueError, match="mixes utterances with and without speaker_id"):
        multi_speaker.synthesize([Utterance([0, 6, 0], speaker_id=0), Utterance([0, 7, 0])])


def test_deterministic_duration_predictor(tmp_path, vits_tokenizer):
    model = load(write_random(tmp_path / "ckpt", "tiny", seed=2, use_stochastic_duration_prediction=False))
    ids = vits_tokenizer.encode("hello world")
    a = model.synthesize([Utterance(ids, noise_scale_duration=0.0, generator=torch.Generator().manual_seed(1))])[0]
    b = model.synthesize([Utterance(ids, noise_scale_duration=1.0, generator=torch.Generator().manual_seed(2))])[0]
    np.testing.assert_array_equal(a.durations.numpy(), b.durations.numpy())  # no noise in its durations


@pytest.mark.parametrize(
    ("lengths", "together", "max_padding", "groups"),
    [
        ([5, 9, 7], False, 0.25, [[0], [1], [2]]),
        ([5, 9, 7], True, float("inf"), [[1, 2, 0]]),
        ([100, 10, 95, 12, 98], True, 0.25, [[0, 4, 2], [3, 1]]),
        ([100, 10], True, 0.25, [[0], [1]]),
        ([], True, 0.25, []),
    ],
)
def test_decode_groups(lengths, together, max_padding, groups):
    assert decode_groups(lengths, together, max_padding) == groups


def test_the_cpu_decodes_row_by_row_by_default(vits_model):
    assert vits_model.batch_decoder is None and not vits_model._together()


def test_no_transformers_at_run_time():
    """Our package loads, tokenises and synthesises without importing transformers (a fresh interpreter)."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from chattts_serve.models.vits.random_checkpoint import write_random\n"
        "from chattts_serve.models.vits.checkpoint import load\n"
        "from chattts_serve.models.vits.tokenizer import VitsTokenizer\n"
        "from chattts_serve.models.vits.model import Utterance\n"
        "import tempfile\n"
        "root = write_random(tempfile.mkdtemp() + '/c', 'tiny', seed=0)\n"
        "load(root).synthesize([Utterance(VitsTokenizer.from_dir(root).encode('hi'))])\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
