"""server/params.py without a server: voice resolution, the default-option layering and the 400s."""

from __future__ import annotations

import pytest

from chattts_serve.audio.policy import StreamPolicy
from chattts_serve.sampling_params import RefineParams
from chattts_serve.server.errors import APIError
from chattts_serve.server.params import (
    ResolvedVoice,
    build_params,
    build_policy,
    request_defaults,
    resolve_voice,
    speed_prompt,
)
from chattts_serve.server.protocol import ChatTTSOptions, StreamOptions
from chattts_serve.server.voices import BUILTIN_VOICES, VoiceStore

SPEAKER = "\u4e00" * 16  # base16384-looking: taken as a speaker string


class FakeEngine:
    """Only what resolve_voice asks of the engine: a speaker per built-in voice's seed."""

    def __init__(self, has_stats: bool = True) -> None:
        self.has_stats = has_stats

    def sample_speaker(self, seed: int) -> str:
        if not self.has_stats:
            raise ValueError("no speaker statistics")
        return f"speaker-{seed}"


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
