"""Kokoro on the model-family seam (``models.kokoro.family``): detection, voices and blends, options, a text's
utterances (sentences, seeds, voice rows) and their speech with word times, on the tiny random checkpoint."""

from __future__ import annotations

import pytest
import torch

from chattts_serve import models
from chattts_serve.engine.config import EngineConfig
from chattts_serve.models.kokoro.family import KokoroFamily, canonical, utterance_seed
from chattts_serve.models.kokoro.model import Utterance as Row
from chattts_serve.models.kokoro.sentences import split_sentences
from chattts_serve.models.kokoro.text import G2P, Token, chunk_text, phonemes_to_ids
from chattts_serve.models.kokoro.voices import blend_voices, style_for
from chattts_serve.sampling_params import SamplingParams

ZH = "你好，世界。今天天气很好！我们去公园吧。"


@pytest.fixture(scope="module")
def served(kokoro_tiny):
    family = models.get("kokoro")
    return family.load(family.resolve(kokoro_tiny), torch.device("cpu"), EngineConfig())


def test_the_registry_knows_kokoro_by_its_files_and_its_hub_repo(kokoro_tiny, tmp_path):
    family = models.detect(kokoro_tiny)
    assert isinstance(family, KokoroFamily) and family.execution == "batch"
    assert (family.capabilities.streaming, family.capabilities.timestamps) == ("sentence", "word")
    assert not family.capabilities.refine and not family.capabilities.control_tokens
    assert models.detect("hexgrad/Kokoro-82M") is family
    assert models.option_owners()["phonemes"] == "kokoro"
    (tmp_path / "config.json").write_text((kokoro_tiny / "config.json").read_text())
    assert models.detect(tmp_path) is family  # incomplete, still Kokoro's: resolve says what it lacks
    with pytest.raises(Exception, match="missing: kokoro-v1_0.pth"):
        family.resolve(tmp_path)


def test_voices_are_the_packs_with_openai_namesakes_where_the_checkpoint_has_them(served, kokoro_tiny, tmp_path):
    voices = served.voices
    assert "zf_xiaobei" in voices.builtin and "alloy" not in voices.builtin  # tiny has no af_alloy
    assert voices.default == "af_heart" and voices.voice("af_sky") == "af_sky"
    assert voices.is_voice("af_bella(0.5)+af_sky(0.5)") and not voices.is_voice("alloy")
    with pytest.raises(ValueError, match="no Kokoro voice 'af_nova' in this checkpoint"):
        voices.check("af_nova")
    full = KokoroFamily().write_random(tmp_path / "k", "tiny")
    for name in ("af_alloy", "am_onyx"):
        torch.save(torch.zeros(510, 1, 256), full / "voices" / f"{name}.pt")
    more = KokoroFamily().load(full, torch.device("cpu"), EngineConfig()).voices
    assert more.voice("alloy") == "af_alloy" and more.voice("onyx") == "am_onyx" and "nova" not in more.builtin


def test_a_blend_is_the_weighted_mean_of_packs_and_its_string_is_canonical(served):
    voices = served.voices
    mixed = voices.blend(["af_bella", "af_sky"], [2, 1])
    assert mixed == "af_bella(0.666667)+af_sky(0.333333)"
    assert voices.blend(["af_bella", "af_sky"], [0.666667, 0.333333]) == mixed  # blending it again: the same
    # nested: flattened (from the 6 digits written: 0.333333 / 2)
    assert voices.blend([mixed, "af_bella"], [1, 1]) == "af_bella(0.833333)+af_sky(0.166666)"
    assert voices.blend(["af_sky", "af_sky"], [1, 3]) == "af_sky"
    expected = blend_voices([(voices.packs["af_bella"], 0.666667), (voices.packs["af_sky"], 0.333333)])
    assert torch.allclose(voices.pack(mixed), expected) and canonical({"af_heart": 3.0}) == "af_heart"
    with pytest.raises(ValueError, match="not a Kokoro voice name"):
        voices.blend(["af_bella", "蘭蘭"], [1, 1])


def test_options_the_family_owns_and_those_it_refuses(served):
    check = served.check_options
    opts = check(SamplingParams(speaker="zf_xiaobei", options={"speed": 1.5}))
    assert (opts.voice, opts.lang, opts.speed) == ("zf_xiaobei", "z", 1.5)
    assert check(SamplingParams(speaker="bf_emma", lang="en")).lang == "b"
    assert check(SamplingParams(speaker="zf_xiaobei", options={"lang_code": "en-us"})).lang == "a"
    assert check(SamplingParams()).voice == "af_heart"
    for params, message in [
        (
            SamplingParams(refine_text=False),
            "option 'refine_text' belongs to the chattts family; this model is a kokoro",
        ),
        (SamplingParams(options={"pitch": 2}), "unknown kokoro option.*pitch.*speed, phonemes, lang_code"),
        (SamplingParams(options={"speed": 9}), "speed must be a number in 0.25..4"),
        (SamplingParams(options={"lang_code": "j"}), "lang_code: 'j' is not a language"),
        (SamplingParams(options={"phonemes": "h§"}), "not in Kokoro's vocabulary"),
        (SamplingParams(speaker="af_bella(0)+af_sky"), "weight must be a positive number"),
    ]:
        with pytest.raises(ValueError, match=message):
            check(params)


def test_english_without_spacy_or_espeak_says_what_to_install(served, kokoro_tiny, monkeypatch):
    from chattts_serve.models.kokoro.text import en

    monkeypatch.setattr(en, "spacy_available", lambda: False)
    monkeypatch.setattr(en, "espeak_available", lambda: False)
    fresh = KokoroFamily().load(kokoro_tiny, torch.device("cpu"), EngineConfig())
    with pytest.raises(ValueError, match=r"cannot phonemize.*Install: pip install 'chattts-serve\[kokoro\]'"):
        fresh.utterances("Hello there.", SamplingParams(speaker="af_heart"))
    assert fresh.utterances("你好。", SamplingParams(speaker="zf_xiaobei"))  # Chinese needs neither


def test_sentences_end_at_their_marks_with_the_closing_ones():
    tokens = [
        Token(t, p) for t, p in [("a", "a"), (".", "."), ("”", "”"), ("b", "b"), ("?", "?"), ("!", "!"), ("c", "c")]
    ]
    assert [[t.text for t in s] for s in split_sentences(tokens)] == [["a", ".", "”"], ["b", "?", "!"], ["c"]]


def test_a_text_is_one_utterance_per_sentence_styled_and_seeded_per_sentence(served):
    utts = served.utterances(ZH, SamplingParams(seed=5, speaker="zf_xiaobei"))
    assert [u.text for u in utts] == ["你好, 世界.", "今天天气很好!", "我们去公园吧."]
    pack = served.voices.pack("zf_xiaobei")
    for i, u in enumerate(utts):
        phonemes = u.inputs.chunk.phonemes
        assert u.work == len(u.inputs.ids) == len(phonemes) + 2
        assert torch.equal(u.inputs.style, style_for(pack, len(phonemes))) and u.inputs.seed == utterance_seed(5, i)
    assert len({u.inputs.seed for u in utts}) == 3
    [whole] = served.utterances(ZH, SamplingParams(seed=5, speaker="zf_xiaobei", split_text=False))
    assert whole.inputs.chunk == chunk_text(G2P("z"), ZH)[0]  # split_text=False: the package's chunk exactly


def test_speech_is_the_models_own_output_with_a_time_for_every_word(served):
    utts = served.utterances(ZH, SamplingParams(seed=5, speaker="zf_xiaobei"))
    speech = served.synthesize(utts)
    rows = [Row(list(u.inputs.ids), u.inputs.style, 1.0, torch.Generator().manual_seed(u.inputs.seed)) for u in utts]
    alone = [r for row in rows for r in served.model.synthesize([row])]  # on a CPU each row runs alone
    for u, s, direct in zip(utts, speech, alone, strict=True):
        assert (s.audio == direct.audio.numpy()).all()  # the seam adds nothing
        words = [t.text for t in u.inputs.chunk.tokens if any(c.isalnum() for c in t.text)]
        assert [w.text for w in s.words] == words
        bounds = [x for w in s.words for x in (w.start, w.end)]
        assert bounds == sorted(bounds) and 0 <= bounds[0] and bounds[-1] <= len(s.audio)
        assert all(w.end > w.start for w in s.words)


def test_phonemes_are_spoken_exactly_as_one_utterance(served):
    ps = "həlˈO wˈɜːld"
    [u] = served.utterances("Hello world", SamplingParams(seed=1, options={"phonemes": ps}))
    assert u.inputs.ids == tuple(phonemes_to_ids(ps, served.vocab)) and u.text == "Hello world"
    [s] = served.synthesize([u])
    assert [w.text for w in s.words] == ["həlˈO", "wˈɜːld"]


def test_ssml_breaks_are_kokoros_pauses_and_prosody_its_speed(served):
    params = SamplingParams(seed=2, speaker="zf_xiaobei")

    def said(text: str) -> list[tuple[str, str, float]]:
        return [(u.text, u.inputs.chunk.phonemes, u.inputs.speed) for u in served.utterances(text, params)]

    # a long break ends a sentence, a short one is a comma; sub and say-as are read as for ChatTTS
    assert said('<speak>你好<break time="500ms"/>世界<break time="100ms"/>和平。</speak>') == said("你好。世界，和平。")
    assert said('<speak><sub alias="世界">地球</sub>。</speak>') == said("世界。")
    assert said('<speak><prosody rate="x-fast">你好。</prosody></speak>') == [(t, p, 2.0) for t, p, _ in said("你好。")]
    two = said('<speak><prosody rate="fast">你好。</prosody><prosody rate="slow">世界。</prosody>和平。</speak>')
    assert [speed for _, _, speed in two] == [1.5, 0.75, 1.0]  # each stretch at its own rate (none: the request's)
    with pytest.raises(ValueError, match="<voice>"):
        served.utterances('<speak>你好<voice name="zm_yunjian">世界</voice></speak>', params)


def test_text_without_a_phoneme_of_the_vocabulary_is_refused_not_sent_to_the_batch(served):
    params = SamplingParams(seed=1, speaker="zf_xiaobei")
    with pytest.raises(ValueError, match="nothing Kokoro can speak"):
        served.utterances("™™", params)
    assert [u.text for u in served.utterances("你好。™™", params)] == ["你好."]  # the rest is spoken


def _english() -> bool:
    from chattts_serve.models.kokoro.text import en

    return en.spacy_available() or en.espeak_available()


@pytest.mark.skipif(
    not _english(), reason="English needs spaCy's en_core_web_sm or espeak-ng (the kokoro-espeak extra)"
)
def test_english_follows_an_english_voice_sentence_by_sentence(served):
    utts = served.utterances("Hello world. How are you today?", SamplingParams(seed=1, speaker="bf_emma"))
    assert [u.text for u in utts] == ["Hello world.", "How are you today?"]
    assert served._g2p.keys() >= {"b"}  # British, from the voice's first letter
    assert [w.text for w in served.synthesize(utts[:1])[0].words] == ["Hello", "world"]


def test_rows_run_one_by_one_on_a_cpu_and_padded_elsewhere(served, monkeypatch):
    """The one rule for batch families (``engine.batch.pads_rows``): the engine hands the whole batch, and the
    model runs it padded only where the rule says so."""
    import chattts_serve.engine.batch as batch_module

    assert not batch_module.pads_rows("cpu") and batch_module.pads_rows("cuda") and batch_module.pads_rows("mps")
    utterances = served.utterances(ZH, SamplingParams(speaker="zf_xiaobei", seed=1))
    assert len(utterances) == 3
    calls: list[int] = []
    real = served.model.synthesize
    monkeypatch.setattr(served.model, "synthesize", lambda rows: calls.append(len(rows)) or real(rows))
    alone = served.synthesize(utterances)
    assert calls == [1, 1, 1]
    calls.clear()
    monkeypatch.setattr(batch_module, "pads_rows", lambda device: True)
    padded = served.synthesize(utterances)
    assert calls == [3]
    for a, b in zip(alone, padded, strict=True):  # the same speech either way (within the batch bound)
        assert a.words == b.words and abs(a.audio - b.audio).max() <= 2e-6


@pytest.mark.parametrize(("audio_dtype", "decoder"), [("auto", torch.float32), ("fp32", torch.float32),
                                                      ("tf32", torch.float32), ("bf16", torch.bfloat16)])
def test_audio_dtype_sets_the_decoder_dtype(kokoro_tiny, audio_dtype, decoder):
    family = models.get("kokoro")
    loaded = family.load(kokoro_tiny, torch.device("cpu"), EngineConfig(audio_dtype=audio_dtype))
    assert loaded.model.decoder_dtype == decoder and loaded.model.bert_encoder.weight.dtype == torch.float32
    speech = loaded.synthesize(loaded.utterances("你好。", SamplingParams(speaker="zf_xiaobei", seed=2)))
    assert speech[0].audio.dtype == "float32" and len(speech[0].audio) > 0


def test_a_gpt_precision_is_refused_with_the_flag_that_applies(kokoro_tiny):
    with pytest.raises(ValueError, match="--precision int8-dynamic is ChatTTS's.*--audio-dtype, or --precision int8"):
        models.get("kokoro").load(kokoro_tiny, torch.device("cpu"), EngineConfig(precision="int8-dynamic"))


def test_auto_audio_dtype_is_bf16_on_cuda(kokoro_tiny, monkeypatch):
    """``--audio-dtype auto`` on CUDA: the decoder's convolutions in bf16 (as ChatTTS's audio decoder). No GPU here:
    the model is loaded on the CPU in place of the device, which is all the choice reads."""
    from chattts_serve.models.kokoro import checkpoint

    real = checkpoint.load
    monkeypatch.setattr(checkpoint, "load", lambda root, device: real(root, "cpu"))
    family = models.get("kokoro")
    assert family.load(kokoro_tiny, torch.device("cuda"), EngineConfig()).model.decoder_dtype == torch.bfloat16
    fp32 = family.load(kokoro_tiny, torch.device("cuda"), EngineConfig(audio_dtype="fp32"))
    assert fp32.model.decoder_dtype == torch.float32


def test_compile_reaches_the_decoder(kokoro_tiny, monkeypatch):
    """``--compile``: the served model's generator blocks get the compiled AdaIN + snake (compiling itself is the
    slow model test's; here torch.compile is stood in for)."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: ("compiled", fn, kw))
    from chattts_serve.engine.config import from_flat

    config = from_flat(compile=True)
    loaded = models.get("kokoro").load(kokoro_tiny, torch.device("cpu"), config)
    fused = {b.fused[0] for b in loaded.model.decoder.generator.resblocks}
    assert fused == {"compiled"} and loaded.model.decoder.generator.resblocks[0].fused[2] == {"dynamic": True}
    plain = models.get("kokoro").load(kokoro_tiny, torch.device("cpu"), EngineConfig())
    assert all(b.fused is None for b in plain.model.decoder.generator.resblocks)
