"""The families' own request options as command-line flags (``synthesize``, ``ray batch``): what the HTTP API
takes as ``noise_scale`` or ``lang_code`` the CLI takes as ``--noise-scale`` or ``--lang-code``, bounded as the
family declares it (``ModelFamily.request_options``) and carried in ``SamplingParams.options``, as the server
carries it. ``SamplingParams``' own fields have their flags already (``sampling_params.add_sampling_arguments``)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from . import detect, families, foreign_options, option_owners
from .family import OptionSpec


def family_flags() -> dict[str, tuple[str, OptionSpec]]:
    """Each option a family owns that is not a ``SamplingParams`` field -> (its family's name, its spec)."""
    from ..sampling_params import option_defaults

    fields = option_defaults()
    return {
        spec.name: (f.name, spec)
        for f in families()
        for spec in f.request_options()
        if spec.name in f.owned_options and spec.name not in fields
    }


def _parser(spec: OptionSpec):
    kind = {"number": float, "integer": int}.get(spec.kind, str)

    def parse(raw: str):
        try:
            value = kind(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {spec.kind}, got {raw!r}") from None
        if kind is float and value != value:  # NaN passes every comparison below
            raise argparse.ArgumentTypeError(f"must be a finite number, got {raw!r}")
        if spec.minimum is not None and value < spec.minimum or spec.maximum is not None and value > spec.maximum:
            raise argparse.ArgumentTypeError(f"must be in [{spec.minimum}, {spec.maximum}], got {raw!r}")
        return value

    return parse


def add_family_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per ``family_flags`` option (default None: the model's own), its help naming its family."""
    for name, (family, spec) in family_flags().items():
        default = f" (default: {spec.default!r})" if spec.default is not None else ""
        if spec.default is None and spec.kind in ("number", "integer"):
            default = " (default: the checkpoint's)"
        p.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=_parser(spec),
            choices=spec.choices or None,
            default=None,
            help=f"{family} only: {spec.help or spec.label}{default}",
        )


def with_family_options(params, args: argparse.Namespace):
    """``params`` (a ``SamplingParams``) with the family flags set in ``args`` in its ``options``. A flag that
    another family than the model's (``--model``, ``--family``: ``detect``) owns is a ValueError naming it and
    both families, before any model loads. No family flag set: ``params`` as it is (and nothing is detected)."""
    given: dict[str, Any] = {n: getattr(args, n) for n in family_flags() if getattr(args, n, None) is not None}
    if not given:
        return params
    family = detect(args.model, getattr(args, "family", None)).name
    message = foreign_options(family, given, option_owners())
    if message is not None:
        raise ValueError(message)
    return replace(params, options={**(params.options or {}), **given})
