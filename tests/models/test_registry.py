"""The model-family registry (``chattts_serve.models``): families, get, detect, option owners; and the
family interface as ChatTTS and the test-only sine family implement it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from chattts_serve import models
from chattts_serve.models.chattts.family import OWNED_OPTIONS, ChatTTSFamily
from chattts_serve.sampling_params import SamplingParams, option_defaults
from tests.support.sine_family import SineFamily, registered


def test_the_built_in_families_and_others_registered_for_as_long_as_asked():
    assert models.names() == ["chattts", "vits", "kokoro"]
    with registered() as sine:
        assert models.names() == ["chattts", "vits", "kokoro", "sine"] and models.get("sine") is sine
    assert models.names() == ["chattts", "vits", "kokoro"]


def test_an_unknown_family_names_the_known_ones():
    with pytest.raises(models.UnknownFamilyError, match=r"family 'bark'; the families are: chattts, vits, kokoro"):
        models.get("bark")


def test_a_family_name_is_checked():
    bad = SineFamily()
    bad.name = "Sine Wave"
    with pytest.raises(ValueError, match="lower-case"):
        models.register(bad)


def test_a_local_directory_is_detected_by_its_files(tiny_ckpt, tmp_path):
    with registered() as sine:
        assert models.detect(tiny_ckpt).name == "chattts"
        assert models.detect(sine.write_random(tmp_path / "s")) is sine
        assert models.detect(tiny_ckpt, family="sine") is sine  # --family wins
        (tmp_path / "empty").mkdir()
        with pytest.raises(models.UnknownFamilyError, match="families are: chattts, vits, kokoro, sine.*--family"):
            models.detect(tmp_path / "empty")


def test_an_incomplete_chattts_directory_is_still_chattts_and_says_what_it_lacks(tmp_path):
    (tmp_path / "asset").mkdir()
    family = models.detect(tmp_path)
    assert family.name == "chattts"
    with pytest.raises(Exception, match="incomplete; missing: asset/gpt/config.json"):
        family.resolve(tmp_path)


def test_a_hub_id_by_the_known_repos_or_family():
    assert models.detect("2Noise/ChatTTS").name == "chattts"
    with registered():
        assert models.detect("tests/sine").name == "sine"
        assert models.detect("someone/fork", family="chattts").name == "chattts"
        with pytest.raises(models.UnknownFamilyError, match="'someone/fork'.*2Noise/ChatTTS.*--family NAME"):
            models.detect("someone/fork")
    with pytest.raises(models.UnknownFamilyError, match="no checkpoint directory 'nowhere'"):
        models.detect("./nowhere")


def test_chattts_owns_its_sampler_refine_prompt_and_voice_sample_options_and_nothing_common():
    flat = set(option_defaults())
    assert OWNED_OPTIONS <= flat
    assert flat - OWNED_OPTIONS == {
        *("seed", "speaker", "lang", "text_cleanup", "lexicon", "split_text", "do_text_normalization", "options"),
        *("max_text_chars", "speed_mode", "stretch"),  # set by the server, whatever the family
    }
    assert models.option_owners()["refine_text"] == "chattts"


def test_a_field_another_family_owns_is_refused_by_name():
    with registered():
        models.check_foreign(SamplingParams(seed=3, speaker="hz:300", lang="en"), "sine")  # common: fine
        with pytest.raises(
            ValueError, match="option 'refine_text' belongs to the chattts family; this model is a sine"
        ):
            models.check_foreign(SamplingParams(refine_text=False), "sine")
        with pytest.raises(ValueError, match="'refine_seed' belongs to the chattts family"):
            models.check_foreign(SamplingParams(refine=SamplingParams().refine.__class__(seed=4)), "sine")
        models.check_foreign(SamplingParams(refine_text=False), "chattts")  # its own


def test_chattts_capabilities_and_shape():
    f = ChatTTSFamily()
    assert (f.execution, f.capabilities.streaming, f.capabilities.timestamps) == ("slots", "window", "sentence")
    assert f.capabilities.refine and f.capabilities.control_tokens


def test_the_registry_imports_no_model_code():
    """``families()`` and ``detect`` run in the CLI and the server's config before a model loads: the registry
    and the family descriptions import no torch and none of the engine's model code."""
    code = textwrap.dedent(
        """
        import sys
        from chattts_serve import models
        models.families()
        watched = ("torch", "chattts_serve.engine.core", "chattts_serve.models.chattts.gpt")
        print([m for m in watched if m in sys.modules])
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
