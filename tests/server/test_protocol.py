"""server.protocol: a family's own request fields come from its package (``ModelFamily.request_options``), so
the server's schema names no family; and outside its package and the registry, nothing imports a family
other than ChatTTS (the first family, still wired through the server's defaults)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from pydantic import ValidationError

from chattts_serve import models
from chattts_serve.models.family import OptionSpec
from chattts_serve.sampling_params import option_defaults
from chattts_serve.server import protocol
from chattts_serve.server.protocol import ChatTTSOptions
from tests.support.sine_family import SineFamily

SRC = Path(protocol.__file__).parents[1]


def test_every_familys_own_options_are_request_fields_with_their_specs_bounds():
    sampling = set(option_defaults())
    seen = 0
    for family in models.families():
        for spec in family.request_options():
            if spec.name not in family.owned_options or spec.name in sampling:
                continue
            seen += 1
            field = ChatTTSOptions.model_fields[spec.name]
            assert field.default is None and family.name in field.description
            if spec.kind == "number":
                ChatTTSOptions(**{spec.name: spec.maximum})
                with pytest.raises(ValidationError, match=spec.name):
                    ChatTTSOptions(**{spec.name: spec.maximum + 1})
                with pytest.raises(ValidationError, match=spec.name):
                    ChatTTSOptions(**{spec.name: float("nan")})
            if spec.kind in ("text", "choice"):
                with pytest.raises(ValidationError, match=spec.name):
                    ChatTTSOptions(**{spec.name: ""})
                if spec.max_length is not None:
                    with pytest.raises(ValidationError, match=spec.name):
                        ChatTTSOptions(**{spec.name: "a" * (spec.max_length + 1)})
    assert seen == 4  # Kokoro's phonemes and lang_code, VITS's noise_scale and noise_scale_duration


class _Tremolo(SineFamily):
    owned_options = frozenset({"tremolo", "vibrato_hz"})

    def request_options(self) -> tuple[OptionSpec, ...]:
        return (
            OptionSpec("tremolo", "boolean", "Tremolo"),
            OptionSpec("vibrato_hz", "number", "Vibrato", None, 0.0, 12.0, help="how fast the pitch wobbles"),
            OptionSpec("speed", "number", "Speed", 1.0, 0.5, 2.0),  # not its own: no field of its making
        )


def test_a_registered_familys_options_become_fields_without_touching_the_server():
    family = models.register(_Tremolo())
    try:
        fields, numbers = protocol._family_fields()
    finally:
        models.unregister(family.name)
    assert {"tremolo", "vibrato_hz"} <= set(fields) and "speed" not in fields
    assert numbers.count("vibrato_hz") == 1 and "tremolo" not in numbers
    kind, field = fields["vibrato_hz"]
    assert kind == float | None and "sine: how fast the pitch wobbles" == field.description
    assert {"tremolo", "vibrato_hz"}.isdisjoint(protocol._family_fields()[0])  # gone with the family


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, as an absolute dotted name."""
    package = ".".join(path.relative_to(SRC.parent).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            out |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return out


@pytest.mark.parametrize("family", ["kokoro", "vits"])
def test_nothing_outside_a_familys_package_imports_it(family):
    inside = SRC / "models" / family
    offenders = [
        str(path.relative_to(SRC))
        for path in SRC.rglob("*.py")
        if inside not in path.parents
        and any(m == f"chattts_serve.models.{family}" or m.startswith(f"chattts_serve.models.{family}.")
                for m in _imports(path))
    ]
    assert offenders == []  # the registry names it by a string (models/__init__.py's _BUILTIN)
