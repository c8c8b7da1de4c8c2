"""VITS as a model family (``models.vits.family``): detection, options, voices, sentences and word timings, and
the engine's batch path on the tiny random checkpoint (batch invariance with seeds)."""

from __future__ import annotations

import numpy as np
import pytest

from chattts_serve import SamplingParams, models
from chattts_serve.engine.config import EngineConfig
from chattts_serve.engine.engine import Engine
from chattts_serve.engine.scheduler import SchedulerConfig
from chattts_serve.models.vits.family import ServedVits, VitsFamily
from chattts_serve.models.vits.random_checkpoint import write_random
from chattts_serve.models.vits.text import align, pieces, sentences
from chattts_serve.models.vits.voices import VitsVoices

# A row's waveform in a batch against itself alone (tests/models/vits/test_model.py's measured bound; on the CPU
# rows decode one by one, so here it is in fact exact).
BATCH_BOUND = 1e-5
TEXT = "Hello, World! The quick brown fox. Kick it."


@pytest.fixture(scope="module")
def engine(vits_tiny):
    return Engine.from_pretrained(vits_tiny, config=EngineConfig(scheduler=SchedulerConfig(max_batch_work=400)))


@pytest.fixture(scope="module")
def multi(tmp_path_factory):
    root = write_random(
        tmp_path_factory.mktemp("vits-ms") / "c", "tiny", seed=1, num_speakers=3, speaker_embedding_size=8
    )
    return Engine.from_pretrained(root)


def test_the_family_is_built_in_and_finds_its_checkpoints(vits_tiny, tmp_path):
    family = models.get("vits")
    assert isinstance(family, VitsFamily) and family.execution == "batch"
    caps = family.capabilities
    assert (caps.streaming, caps.timestamps, caps.refine, caps.control_tokens) == ("sentence", "word", False, False)
    assert models.detect(vits_tiny) is family
    for repo in ("facebook/mms-tts-eng", "facebook/mms-tts-fra", "facebook/mms-tts-uig-script_arabic"):
        assert models.detect(repo) is family  # every MMS-TTS repo, by pattern, without a download
    with pytest.raises(models.UnknownFamilyError, match="facebook/mms-tts-eng"):
        models.detect("facebook/wav2vec2-base")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text('{"model_type": "bert"}')
    (tmp_path / "c" / "model.safetensors").write_bytes(b"")
    (tmp_path / "c" / "vocab.json").write_text("{}")
    assert not family.is_checkpoint(tmp_path / "c")  # another model type


def test_an_incomplete_directory_says_what_it_lacks(vits_tiny, tmp_path):
    import shutil

    root = shutil.copytree(vits_tiny, tmp_path / "c")
    (root / "tokenizer_config.json").unlink()
    with pytest.raises(Exception, match="incomplete; missing: tokenizer_config.json"):
        models.get("vits").resolve(root)


def test_the_engine_serves_it_at_the_checkpoints_rate_with_word_timings(engine):
    assert engine.family.name == "vits" and engine.sample_rate == 16000
    [r] = engine.synthesize(TEXT, SamplingParams(seed=3))
    assert r.text == ["Hello, World!", "The quick brown fox.", "Kick it."] and r.finish_reason == "stop"
    assert r.sample_rate == 16000 and r.spans[-1].end == len(r.audio) > 0
    first, second, third = r.spans
    assert [w.text for w in first.words] == ["Hello,", "World!"]  # as written; the model reads "hello world"
    assert [w.text for w in third.words] == ["Kick", "it."]  # "k" is MMS English's pad token: one id, no blanks
    hop = engine.family_model.model.config.samples_per_frame
    for span in r.spans:
        starts = [w.start for w in span.words]
        assert starts == sorted(starts) and all(span.start <= w.start < w.end <= span.end for w in span.words)
        assert all((w.start - span.start) % hop == 0 and (w.end - w.start) % hop == 0 for w in span.words)
    assert second.words[0].start >= second.start


def test_word_runs_are_the_ids_of_their_characters(vits_tokenizer):
    piece = align(vits_tokenizer, "Hi, Bob!")
    assert [w for w, _, _ in piece.words] == ["Hi,", "Bob!"]
    enc = vits_tokenizer.encode("Hi, Bob!")
    assert list(piece.ids) == enc
    vocab = {v: k for k, v in vits_tokenizer.vocab.items()}
    spelled = ["".join(vocab[i] for i in piece.ids[s:e] if i != 0) for _, s, e in piece.words]
    assert spelled == ["hi", "bob"]  # blank (id 0) between the characters
    assert sentences("One. Two!  Three?\nFour。五") == ["One.", "Two!", "Three?", "Four。", "五"]


def test_a_long_sentence_is_cut_at_words_to_fit(vits_tokenizer):
    text = " ".join(["word"] * 40)  # 40 * 5 characters, ~400 ids
    chunks = pieces(vits_tokenizer, text, 64)
    assert len(chunks) > 1 and all(len(p.ids) <= 64 for p in chunks)
    assert " ".join(p.text for p in chunks) == text
    [single] = pieces(vits_tokenizer, "a" * 100, 64)[:1]  # one word longer than the limit: cut inside it
    assert len(single.ids) <= 64


def test_seeds_repeat_and_a_row_equals_itself_alone(engine):
    texts = [TEXT, "Yes.", "A rather longer sentence, with commas, to pad the batch.", "No"]
    seeds = [5, 6, 7, 8]
    batched = engine.synthesize(texts, [SamplingParams(seed=s) for s in seeds])
    model: ServedVits = engine.family_model
    assert max(model.batches[-3:]) > 1  # they did share batches
    for text, seed, together in zip(texts, seeds, batched, strict=True):
        [alone] = engine.synthesize(text, SamplingParams(seed=seed))
        assert len(alone.audio) == len(together.audio)  # durations exact
        assert [s.end for s in alone.spans] == [s.end for s in together.spans]
        assert [w for s in alone.spans for w in s.words] == [w for s in together.spans for w in s.words]
        assert float(np.abs(alone.audio - together.audio).max()) <= BATCH_BOUND
    [other] = engine.synthesize(texts[0], SamplingParams(seed=99))
    assert len(other.audio) != len(batched[0].audio) or not np.array_equal(other.audio, batched[0].audio)


def test_the_first_sentence_repeats_manual_seed(engine):
    """A one-sentence request's generator is seeded with the request's seed itself (transformers' run after
    ``torch.manual_seed(seed)``): the model alone with that generator gives the same audio."""
    import torch

    from chattts_serve.models.vits.model import Utterance

    [r] = engine.synthesize("hello world", SamplingParams(seed=42))
    model = engine.family_model.model
    ids = engine.family_model.tokenizer.encode("hello world")
    [syn] = model.synthesize([Utterance(ids, generator=torch.Generator().manual_seed(42))])
    np.testing.assert_array_equal(r.audio, syn.audio.numpy())


def test_speed_and_noise_options(engine):
    [normal] = engine.synthesize("the quick brown fox", SamplingParams(seed=1))
    [fast] = engine.synthesize("the quick brown fox", SamplingParams(seed=1, options={"speed": 3.0}))
    assert len(fast.audio) < len(normal.audio)
    [quiet] = engine.synthesize("the quick brown fox", SamplingParams(seed=1, options={"noise_scale": 0.0}))
    assert len(quiet.audio) == len(normal.audio) and not np.array_equal(quiet.audio, normal.audio)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(refine_text=False), "option 'refine_text' belongs to the chattts family; this model is a vits"),
        (SamplingParams(temperature=0.5), "option 'temperature' belongs to the chattts family"),
        (SamplingParams(options={"pitch": 3}), "unknown vits option"),
        (SamplingParams(options={"speed": 9.0}), r"speed must be a number in 0.25..4"),
        (SamplingParams(options={"noise_scale": -1}), r"noise_scale must be a number in 0..10"),
        (SamplingParams(options={"noise_scale_duration": True}), "noise_scale_duration must be a number"),
        (SamplingParams(speaker="speaker_1"), "one speaker: its only voice is 'default'"),
    ],
)
def test_bad_options_are_refused_before_any_compute(engine, params, message):
    model = engine.family_model
    before = list(model.batches)
    with pytest.raises(ValueError, match=message):
        engine.synthesize("Hello.", params)
    assert model.batches == before


def test_text_with_nothing_the_vocabulary_has_is_refused(engine):
    with pytest.raises(ValueError, match="nothing to speak"):
        engine.synthesize("!!! ???", SamplingParams())


def test_single_speaker_voices(engine):
    voices = engine.voices
    assert voices.builtin == ("default",) and voices.voice("default") == "default"
    assert voices.is_voice("default") and not voices.is_voice("alloy")
    with pytest.raises(ValueError, match="nothing to blend"):
        voices.blend(["default", "default"], [1, 1])


def test_multi_speaker_voices_and_blends(multi):
    voices = multi.voices
    assert voices.builtin == ("speaker_0", "speaker_1", "speaker_2")
    assert voices.blend(["speaker_0", "speaker_2"], [1, 3]) == "speakers:0=0.25,2=0.75"
    assert voices.blend(["speaker_1", "speaker_1"], [1, 2]) == "speaker_1"
    with pytest.raises(ValueError, match="speakers 0 .. 2, got speaker 3"):
        voices.check("speaker_3")
    with pytest.raises(ValueError, match="speaker_0 .. speaker_2"):
        voices.check("default")
    p = {
        s: multi.synthesize("hello world", SamplingParams(seed=1, speaker=s))[0].audio
        for s in ("speaker_0", "speaker_2", "speakers:0=0.5,2=0.5")
    }
    [none] = multi.synthesize("hello world", SamplingParams(seed=1))
    np.testing.assert_array_equal(none.audio, p["speaker_0"])  # no voice: speaker 0
    assert not np.array_equal(p["speaker_0"], p["speaker_2"])
    blend = p["speakers:0=0.5,2=0.5"]
    assert not any(len(blend) == len(p[s]) and np.array_equal(blend, p[s]) for s in ("speaker_0", "speaker_2"))


def test_voice_strings_parse():
    v = VitsVoices(4)
    assert v.mix("speakers:3=1,1=3") == ((3, 0.25), (1, 0.75))
    for bad in ("speakers:1=0", "speakers:1=1,1=2", "speakers:9=1", "speakers:1=x"):
        with pytest.raises(ValueError):
            v.mix(bad)


def test_another_familys_precision_is_refused(vits_tiny):
    with pytest.raises(ValueError, match="--precision int8-dynamic is another family's"):
        Engine.from_pretrained(vits_tiny, config=EngineConfig(precision="int8-dynamic"))


def test_ssml_breaks_end_sentences_and_prosody_sets_the_rate(engine):
    """SSML is read as for ChatTTS; VITS has no pause token, so a <break> ends a sentence there, and <prosody
    rate> (which reaches the family as ChatTTS's [speed_N]) sets the speaking rate."""
    ssml = '<speak>Hello <break time="500ms"/> big world. <say-as interpret-as="characters">ab</say-as></speak>'
    [r] = engine.synthesize(ssml, SamplingParams(seed=2))
    assert r.text == ["Hello", "big world.", "A B"]
    assert "speak" not in " ".join(w.text for s in r.spans for w in s.words)
    [plain] = engine.synthesize("<speak>the quick brown fox jumps</speak>", SamplingParams(seed=2))
    [fast] = engine.synthesize(
        '<speak><prosody rate="x-fast">the quick brown fox jumps</prosody></speak>', SamplingParams(seed=2)
    )
    [slow] = engine.synthesize(
        "<speak>the quick brown fox jumps</speak>", SamplingParams(seed=2, options={"speed": 0.5})
    )
    assert len(fast.audio) < len(plain.audio) < len(slow.audio)
    with pytest.raises(ValueError, match="unknown"):
        engine.synthesize("<speak><foo>x</foo></speak>", SamplingParams())


def test_split_text_off_speaks_the_text_as_one_utterance(engine):
    [r] = engine.synthesize("Hello, World! The quick\nbrown fox.", SamplingParams(seed=1, split_text=False))
    assert r.text == ["Hello, World! The quick brown fox."] and len(r.spans[0].words) == 6


def test_served_requests_equal_transformers_recorded_output(tmp_path):
    """The golden cases (transformers' ``VitsModel`` after ``torch.manual_seed(seed)``, recorded in
    golden/tiny.npz) as one-sentence requests through the engine, all three in one batch: the options map onto
    transformers' (``speed`` -> ``speaking_rate``, the noise scales), the request's seed onto its seed, and each
    request's audio is transformers' bit for bit."""
    from pathlib import Path

    from .cases import CASES, GOLDEN_CHECKPOINT_SEED

    golden = dict(np.load(Path(__file__).parent / "golden" / "tiny.npz"))
    engine = Engine.from_pretrained(write_random(tmp_path / "golden", "tiny", seed=GOLDEN_CHECKPOINT_SEED))
    params = [
        SamplingParams(
            seed=c["seed"],
            options={
                k: c[v]
                for k, v in (
                    ("speed", "speaking_rate"),
                    ("noise_scale", "noise_scale"),
                    ("noise_scale_duration", "noise_scale_duration"),
                )
            },
        )
        for c in CASES
    ]
    results = engine.synthesize([c["text"] for c in CASES], params)
    assert max(engine.family_model.batches) == len(CASES)  # one batch
    for i, r in enumerate(results):
        assert len(r.spans) == 1
        np.testing.assert_array_equal(r.audio, golden[f"{i}/audio"])
