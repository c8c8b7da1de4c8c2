"""The flat sampling options: one default (the dataclasses) and one set of bounds (``OPTION_BOUNDS``),
read alike by the HTTP schema and the CLI flags."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from chattts_serve.sampling_params import (
    OPTION_BOUNDS,
    SAMPLING_FLAGS,
    RefineParams,
    SamplingParams,
    add_sampling_arguments,
    option_defaults,
)
from chattts_serve.server.protocol import ChatTTSOptions


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_sampling_arguments(p)
    return p


def from_cli(*argv: str) -> SamplingParams:
    args = parser().parse_args(list(argv))
    return SamplingParams.from_options(**{name: getattr(args, name) for name in SAMPLING_FLAGS})


def test_no_flags_keep_the_dataclass_defaults():
    assert from_cli() == SamplingParams()


def test_lang_and_every_refine_option_have_a_flag():
    refine = {f"refine_{name}" for name in RefineParams.__dataclass_fields__}
    assert {"lang"} | refine <= set(SAMPLING_FLAGS)
    p = from_cli(
        *("--lang", "en", "--no-refine", "--refine-prompt", "[oral_2]", "--refine-temperature", "0.5"),
        *("--refine-top-p", "0.9", "--refine-top-k", "5", "--refine-repetition-penalty", "1.1"),
        *("--refine-min-new-tokens", "2", "--refine-max-new-tokens", "100", "--refine-seed", "3"),
        *("--no-homophone-replacement",),
    )
    assert p.lang == "en" and p.refine_text is False and p.do_homophone_replacement is False
    assert p.refine == RefineParams("[oral_2]", 0.5, 0.9, 5, 1.1, 2, 100, 3)


def _outside(name: str, bounds: dict) -> list:
    """Values just past each of ``name``'s bounds, typed as the option is."""
    if "max_length" in bounds:
        return ["x" * (bounds["max_length"] + 1)]
    kind = float if isinstance(option_defaults()[name], float) else int
    out = []
    for key, bound in bounds.items():
        out.append(kind({"gt": bound, "lt": bound, "ge": bound - 1, "le": bound + 1}[key]))
    return out


def test_the_api_takes_every_bounded_option():
    assert set(OPTION_BOUNDS) <= set(ChatTTSOptions.model_fields)


@pytest.mark.parametrize("name", sorted(OPTION_BOUNDS))
def test_the_api_and_the_cli_refuse_the_same_values(name):
    flag = "--" + name.replace("_", "-")
    for value in _outside(name, OPTION_BOUNDS[name]):
        with pytest.raises(argparse.ArgumentError):
            parser().parse_args([flag, str(value)])
        with pytest.raises(ValidationError):
            ChatTTSOptions(**{name: value})
