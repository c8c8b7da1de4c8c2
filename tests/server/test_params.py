"""server/params.py without a server: voice resolution, the default-option layering and the 400s."""

from __future__ import annotations

import numpy as np
import pytest

from chattts_serve.audio.policy import StreamPolicy
from chattts_serve.models.chattts import voices as voices_module
from chattts_serve.models.chattts.speaker import blend_speakers, decode_speaker, default_speaker_stats
from chattts_serve.models.chattts.voices import ChatTTSVoices
from chattts_serve.sampling_params import RefineParams, speed_prompt
from chattts_serve.server.errors import APIError
from chattts_serve.server.params import (
    ResolvedVoice,
    build_params,
    build_policy,
    request_defaults,
    resolve_voice,
)
from chattts_serve.server.protocol import ChatTTSOptions, StreamOptions
from chattts_serve.server.voices import BUILTIN_VOICES, VoiceStore

SPEAKER = "\u4e00" * 16  # base16384-looking: taken as a speaker string


class FakeVoices(ChatTTSVoices):
    """ChatTTS's voices with a made-up speaker per built-in voice's seed."""

    def sample(self, seed: int | None = None) -> str:
        return f"speaker-{seed}"


class FakeEngine:
    """Only what resolve_voice asks of the engine: its family's voices."""

    def __init__(self, has_stats: bool = True) -> None:
        self.voices = FakeVoices(object() if has_stats else None, 768)


@pytest.fixture
def store():
    s = VoiceStore(":memory:")
    yield s
    s.close()


def test_speed_maps_onto_the_ten_speed_levels():
    assert speed_prompt(1.0) == "[speed_5]"
    assert speed_prompt(2.0) == "[speed_8]"  # 5 + 2.5, rounded half to even
    assert speed_prompt(0.5) == "[speed_2]"
    assert speed_prompt(0.25) == "[speed_0]" and speed_prompt(4.0) == "[speed_9]"  # clamped at both ends


def test_voice_resolution_order(store):
    engine = FakeEngine()
    assert resolve_voice(store, engine, None, None, "voice") == ResolvedVoice()
    assert resolve_voice(store, engine, "alloy", None, "voice").speaker == f"speaker-{BUILTIN_VOICES['alloy']}"
    assert resolve_voice(store, engine, None, "echo", "voice").speaker == f"speaker-{BUILTIN_VOICES['echo']}"
    assert resolve_voice(store, engine, SPEAKER, None, "voice") == ResolvedVoice(speaker=SPEAKER)
    store.add("alloy", sample_codes="codes", sample_text="hello")  # a saved voice shadows the built-in name
    assert resolve_voice(store, engine, "alloy", None, "voice") == ResolvedVoice(None, "codes", "hello")


def test_a_saved_voice_is_found_only_in_its_tenant(store):
    engine = FakeEngine()
    store.add("mine", speaker=SPEAKER, tenant="b")
    store.add("alloy", speaker=SPEAKER, tenant="b")  # shadows the built-in name for tenant b only
    assert resolve_voice(store, engine, "mine", None, "voice", tenant="b") == ResolvedVoice(speaker=SPEAKER)
    for tenant in ("a", None):
        with pytest.raises(APIError) as exc:
            resolve_voice(store, engine, "mine", None, "voice", tenant=tenant)
        assert exc.value.code == "unknown_voice"
        builtin = f"speaker-{BUILTIN_VOICES['alloy']}"
        assert resolve_voice(store, engine, "alloy", None, "voice", tenant=tenant).speaker == builtin


def test_builtin_voice_without_speaker_statistics_is_no_speaker(store):
    assert resolve_voice(store, FakeEngine(has_stats=False), "nova", None, "voice") == ResolvedVoice()


def test_unknown_voice_is_a_400_naming_the_param(store):
    with pytest.raises(APIError) as exc:
        resolve_voice(store, FakeEngine(), "nobody", None, "speaker")
    assert exc.value.status_code == 400 and exc.value.code == "unknown_voice" and exc.value.param == "speaker"


def test_request_options_win_over_server_defaults():
    defaults = request_defaults('{"seed": 7, "temperature": 0.5, "prompt": "[speed_2]"}')
    params = build_params(ChatTTSOptions(temperature=0.9), ResolvedVoice(speaker=SPEAKER), defaults=defaults)
    assert (params.seed, params.temperature, params.prompt, params.speaker) == (7, 0.9, "[speed_2]", SPEAKER)
    assert build_params(ChatTTSOptions(), ResolvedVoice()).prompt == "[speed_5]"  # no defaults: SamplingParams'


def test_every_refine_option_reaches_the_params():
    opts = ChatTTSOptions(
        refine_prompt="[oral_2]", refine_temperature=0.5, refine_top_p=0.9, refine_top_k=5,
        refine_repetition_penalty=1.1, refine_min_new_tokens=2, refine_max_new_tokens=100, refine_seed=3,
    )  # fmt: skip
    assert build_params(opts, ResolvedVoice()).refine == RefineParams("[oral_2]", 0.5, 0.9, 5, 1.1, 2, 100, 3)


def test_implied_prompt_beats_defaults_but_not_the_requests_own():
    defaults = request_defaults('{"prompt": "[speed_2]"}')
    implied = build_params(ChatTTSOptions(), ResolvedVoice(), prompt="[speed_8]", defaults=defaults)
    assert implied.prompt == "[speed_8]"
    own = build_params(ChatTTSOptions(prompt="[speed_1]"), ResolvedVoice(), prompt="[speed_8]", defaults=defaults)
    assert own.prompt == "[speed_1]"


def test_voice_sample_reaches_the_params():
    params = build_params(ChatTTSOptions(), ResolvedVoice(None, "codes", "hello"))
    assert (params.speaker, params.speaker_sample, params.speaker_sample_text) == (None, "codes", "hello")


def test_options_the_engine_refuses_are_a_400():
    bad = ChatTTSOptions.model_construct(temperature=[0.3, 0.3])  # past pydantic: SamplingParams refuses it
    with pytest.raises(APIError) as exc:
        build_params(bad, ResolvedVoice())
    assert exc.value.status_code == 400 and "temperature" in str(exc.value.detail)


def test_chunking_overrides_the_server_policy():
    default = StreamPolicy()
    assert build_policy(default, None) is default
    assert build_policy(default, StreamOptions(first_chunk=8)) == StreamPolicy(first_chunk=8)
    with pytest.raises(APIError) as exc:
        build_policy(default, StreamOptions(first_chunk=200, max_chunk=100))
    assert exc.value.status_code == 400 and exc.value.param == "chunking"


# ---------------------------------------------------------------- blends ("a(2)+b(1)")


class BlendEngine:
    """What a blend asks of the engine: real speakers for the built-in voices, the statistics, the dimension."""

    hidden_size = 768

    def __init__(self, has_stats: bool = True) -> None:
        self.speaker_stats = default_speaker_stats() if has_stats else None
        self.voices = ChatTTSVoices(self.speaker_stats, self.hidden_size)

    def sample_speaker(self, seed: int) -> str:
        return self.voices.sample(seed)


def speaker_of(engine, name: str) -> np.ndarray:
    return decode_speaker(engine.sample_speaker(BUILTIN_VOICES[name]))


def test_a_blend_of_builtin_voices_is_their_mix(store):
    engine = BlendEngine()
    mixed = resolve_voice(store, engine, "alloy(2)+nova(1)", None, "voice")
    assert mixed.sample is None and mixed.speaker is not None
    # the weights as mixed: normalised, to four decimals (models.chattts.voices.canonical_blend)
    expected = blend_speakers(
        [speaker_of(engine, "alloy"), speaker_of(engine, "nova")], [0.6667, 0.3333], engine.speaker_stats
    )
    assert np.array_equal(decode_speaker(mixed.speaker), expected)
    assert resolve_voice(store, engine, "alloy(4) + nova(2)", None, "voice") == mixed  # the same blend, same speaker
    assert resolve_voice(store, engine, "alloy+nova", None, "voice") != mixed
    alloy = resolve_voice(store, engine, "alloy", None, "voice")
    assert resolve_voice(store, engine, "alloy(3)", None, "voice") == alloy  # one term: that voice
    assert np.array_equal(
        decode_speaker(resolve_voice(store, engine, "alloy+alloy", None, "voice").speaker), speaker_of(engine, "alloy")
    )


def test_blends_that_cannot_sound_different_are_one_mix(store, monkeypatch):
    """The mix is cached by the canonical blend (normalised, rounded weights; one term per voice), not by the
    weights as written: many near-equal blends in one request buy one mix (issue 29, item 4)."""
    engine = BlendEngine()
    mixes = []
    real = voices_module.blend_speakers
    monkeypatch.setattr(voices_module, "blend_speakers", lambda *a: mixes.append(a) or real(*a))
    voices_module._mixed_speaker.cache_clear()
    names = ["alloy", "nova", "echo", "onyx"]
    blends = ["+".join(f"{v}({1 + (i + k) * 1e-6:.6f})" for k, v in enumerate(names)) for i in range(20)]
    speakers = {resolve_voice(store, engine, b, None, "voice").speaker for b in blends}
    assert len(speakers) == 1 and len(mixes) == 1
    assert resolve_voice(store, engine, "nova(1)+alloy(3)", None, "voice") == resolve_voice(
        store, engine, "alloy(1.5)+nova(1)+alloy(1.5)", None, "voice"
    )  # order, scale and a repeated voice do not make another blend
    assert len(mixes) == 2
    assert voices_module.canonical_blend([b"a", b"b"], [1, 1e-9]) == ((b"a",), (1.0,))  # a term that adds nothing


def test_a_blend_mixes_saved_voices_and_speaker_strings(store):
    engine = BlendEngine()
    echo = engine.sample_speaker(BUILTIN_VOICES["echo"])
    store.add("mine", speaker=engine.sample_speaker(5))
    mixed = resolve_voice(store, engine, f"mine(1)+{echo}(3)", None, "speaker")
    expected = blend_speakers(
        [decode_speaker(engine.sample_speaker(5)), decode_speaker(echo)], [1, 3], engine.speaker_stats
    )
    assert np.array_equal(decode_speaker(mixed.speaker), expected)
    assert resolve_voice(store, engine, None, "mine(1)+echo(3)", "voice") == mixed  # a default voice may be a blend


def test_a_blend_resolves_names_in_the_callers_tenant(store):
    engine = BlendEngine()
    store.add("mine", speaker=engine.sample_speaker(5), tenant="b")
    assert resolve_voice(store, engine, "mine+alloy", None, "voice", tenant="b").speaker is not None
    for tenant in ("a", None):
        with pytest.raises(APIError) as exc:
            resolve_voice(store, engine, "alloy+mine", None, "voice", tenant=tenant)
        assert exc.value.status_code == 400 and exc.value.code == "unknown_voice" and "'mine'" in exc.value.detail


def test_a_voice_sample_cannot_be_blended(store):
    engine = BlendEngine()
    store.add("rec", sample_codes="codes", sample_text="hello")
    with pytest.raises(APIError) as exc:
        resolve_voice(store, engine, "alloy(2)+rec(1)", None, "voice")
    assert exc.value.status_code == 400 and exc.value.code == "invalid_blend" and "'rec'" in exc.value.detail
    assert resolve_voice(store, engine, "rec(2)", None, "voice") == ResolvedVoice(None, "codes", "hello")  # alone: fine


@pytest.mark.parametrize(
    ("voice", "code", "says"),
    [
        ("alloy(0)+nova", "invalid_blend", "'alloy(0)'"),
        ("alloy+", "invalid_blend", "term 2 is empty"),
        ("alloy+nobody", "unknown_voice", "'nobody'"),
        ("+".join(["alloy"] * 9), "invalid_blend", "at most 8"),
        ("alloy+" + "\u4e00" * 16, "invalid_blend", "blend term '\u4e00"),  # looks like a speaker string; is not one
    ],
)
def test_bad_blends_are_400s_naming_the_term(store, voice, code, says):
    with pytest.raises(APIError) as exc:
        resolve_voice(store, BlendEngine(), voice, None, "speaker")
    err = exc.value
    assert (err.status_code, err.code, err.param) == (400, code, "speaker") and says in err.detail, err.detail


def test_builtin_voices_without_statistics_cannot_be_blended(store):
    with pytest.raises(APIError) as exc:
        resolve_voice(store, BlendEngine(has_stats=False), "alloy+nova", None, "voice")
    assert exc.value.code == "invalid_blend" and "'alloy'" in exc.value.detail


def test_vitss_noise_scales_travel_in_its_options_over_the_servers_defaults():
    from chattts_serve import models

    vits = models.get("vits")
    defaults = request_defaults('{"noise_scale": 0.3, "noise_scale_duration": 0.4, "temperature": 0.5}')
    params = build_params(ChatTTSOptions(noise_scale=0.0), ResolvedVoice(), defaults=defaults, family=vits)
    assert params.options == {"noise_scale": 0.0, "noise_scale_duration": 0.4}  # ChatTTS's default left out
    assert build_params(ChatTTSOptions(), ResolvedVoice(), family=vits).options is None


@pytest.mark.parametrize("family", ["chattts", "kokoro"])
def test_vitss_noise_scale_is_a_400_on_another_family_naming_it(family):
    from chattts_serve import models

    with pytest.raises(APIError) as exc:
        build_params(ChatTTSOptions(noise_scale_duration=0.5), ResolvedVoice(), family=models.get(family))
    error = exc.value
    assert (error.status_code, error.param, error.code) == (400, "noise_scale_duration", "unsupported_option")
    assert "belongs to the vits family" in str(error.detail)
