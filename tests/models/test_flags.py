"""The families' own options as command-line flags (``models.flags``): bounded as each family declares them,
carried in ``SamplingParams.options``, and refused by name for another family's model before it loads."""

from __future__ import annotations

import argparse

import pytest

from chattts_serve import models
from chattts_serve.models.flags import add_family_arguments, family_flags, with_family_options
from chattts_serve.models.vits.random_checkpoint import write_random
from chattts_serve.sampling_params import SamplingParams


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    p.add_argument("--model")
    p.add_argument("--family")
    add_family_arguments(p)
    return p


def test_every_family_owned_option_outside_sampling_params_is_a_flag():
    flags = family_flags()
    assert {n: f for n, (f, _) in flags.items()} == {
        "noise_scale": "vits",
        "noise_scale_duration": "vits",
        "lang_code": "kokoro",
        "phonemes": "kokoro",
    }
    owners = models.option_owners()
    assert all(owners[n] == family for n, (family, _) in flags.items())


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--noise-scale", "10.5"], "must be in [0.0, 10.0], got '10.5'"),
        (["--noise-scale-duration", "-1"], "must be in [0.0, 10.0], got '-1'"),
        (["--noise-scale", "nan"], "must be a finite number"),
        (["--noise-scale", "loud"], "expected a number, got 'loud'"),
        (["--lang-code", "q"], "invalid choice: 'q'"),
    ],
)
def test_a_bad_value_is_a_usage_error_naming_it(capsys, argv, message):
    p = parser()
    p.exit_on_error = True
    with pytest.raises(SystemExit) as info:
        p.parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and argv[0] in err


def test_set_flags_travel_in_the_options_and_unset_ones_do_not(tmp_path):
    root = write_random(tmp_path / "v", "tiny")
    base = SamplingParams(seed=3)
    args = parser().parse_args(["--model", str(root), "--noise-scale", "0", "--noise-scale-duration", "0.5"])
    params = with_family_options(base, args)
    assert params.options == {"noise_scale": 0.0, "noise_scale_duration": 0.5} and params.seed == 3
    # None set: the params as they were, and the model is not even looked at (no detection).
    assert with_family_options(base, parser().parse_args(["--model", "/nonexistent"])) is base


def test_another_familys_flag_is_refused_naming_both_families(tmp_path):
    root = models.get("kokoro").write_random(tmp_path / "k", "tiny")
    args = parser().parse_args(["--model", str(root), "--noise-scale", "0.3"])
    with pytest.raises(ValueError, match="option 'noise_scale' belongs to the vits family; this model is a kokoro"):
        with_family_options(SamplingParams(), args)
    vits = write_random(tmp_path / "v", "tiny")
    args = parser().parse_args(["--model", str(vits), "--lang-code", "z"])
    with pytest.raises(ValueError, match="option 'lang_code' belongs to the kokoro family; this model is a vits"):
        with_family_options(SamplingParams(), args)
