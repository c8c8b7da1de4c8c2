"""Model families and their registry: ``families()``, ``get(name)``, ``detect(path_or_repo, family=None)``.

Each family lives in its own package (``models/chattts/``, ``models/kokoro/``) with a ``family.py`` that
defines its ``ModelFamily`` (``models.family``). The built-in families are listed here by import path and
imported on first use, so asking for the registry loads no model code (and no torch). A third family: a
package ``models/<name>/`` with ``family.py``, one line in ``_BUILTIN``, and its section in the README.
Tests register their own with ``register`` (``tests/support/sine_family.py``).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from .family import ModelFamily, foreign_options

_BUILTIN: dict[str, str] = {
    "chattts": "chattts_serve.models.chattts.family:ChatTTSFamily",
    "vits": "chattts_serve.models.vits.family:VitsFamily",
    "kokoro": "chattts_serve.models.kokoro.family:KokoroFamily",
}
"""name -> "module:class" of the families that ship with the package, in detection order."""

_registered: dict[str, ModelFamily] = {}


class UnknownFamilyError(ValueError):
    """No family by that name, or no family recognises a checkpoint. The message lists the families."""


def register(family: ModelFamily) -> ModelFamily:
    """Add (or replace) a family by its name; returns it."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", getattr(family, "name", "") or ""):
        raise ValueError(f"a family's name must be lower-case letters, digits and _, got {family.name!r}")
    _registered[family.name] = family
    return family


def unregister(name: str) -> None:
    """Remove a family added with ``register`` (tests); a built-in one comes back on next use."""
    _registered.pop(name, None)


def _load_builtin(name: str) -> ModelFamily:
    module, _, cls = _BUILTIN[name].partition(":")
    return register(getattr(importlib.import_module(module), cls)())


def families() -> list[ModelFamily]:
    """Every family: the built-in ones (in detection order), then the registered ones."""
    for name in _BUILTIN:
        if name not in _registered:
            _load_builtin(name)
    return [_registered[n] for n in _BUILTIN] + [f for n, f in _registered.items() if n not in _BUILTIN]


def names() -> list[str]:
    return [f.name for f in families()]


def get(name: str) -> ModelFamily:
    """The family called ``name``; UnknownFamilyError listing the families otherwise."""
    if name in _registered:
        return _registered[name]
    if name in _BUILTIN:
        return _load_builtin(name)
    raise UnknownFamilyError(f"unknown model family {name!r}; the families are: {', '.join(names())}")


def option_owners() -> dict[str, str]:
    """Every family-owned request option -> its family's name (``ModelFamily.owned_options``)."""
    return {option: f.name for f in families() for option in f.owned_options}


def check_foreign(params, family: str) -> None:
    """Raise ValueError naming the first field of ``params`` (a ``SamplingParams``), set away from its default,
    that a family other than ``family`` owns: what a family's ``check_options`` does first."""
    from ..sampling_params import flat_options, option_defaults

    defaults = option_defaults()
    given = {k: v for k, v in flat_options(params).items() if k in defaults and v != defaults[k]}
    message = foreign_options(family, given, option_owners())
    if message is not None:
        raise ValueError(message)


def detect(path_or_repo: str | Path, family: str | None = None) -> ModelFamily:
    """The family of a checkpoint. ``family`` (``--family``) wins. Otherwise a local directory is
    recognised by its files (``ModelFamily.is_checkpoint``) and a hub id by the families' known repos
    (``ModelFamily.hub_repos``). Raises UnknownFamilyError listing the families when nothing matches."""
    if family is not None:
        return get(family)
    path = Path(path_or_repo).expanduser()
    if path.is_dir():
        for f in families():
            if f.is_checkpoint(path):
                return f
        raise UnknownFamilyError(
            f"no model family recognises the checkpoint in {str(path)!r}; the families are: "
            f"{', '.join(names())} (pass --family NAME to force one)"
        )
    repo = str(path_or_repo)
    for f in families():
        if repo in f.hub_repos:
            return f
    if path.exists():
        raise UnknownFamilyError(f"{str(path)!r} is a file; expected a checkpoint directory")
    if repo.startswith((".", "/", "~")) or not re.fullmatch(r"[\w.-]+/[\w.-]+", repo):
        raise UnknownFamilyError(f"no checkpoint directory {str(path)!r} (and it is not a Hugging Face repo id)")
    raise UnknownFamilyError(
        f"{repo!r} is neither a checkpoint directory nor a known hub repo "
        f"({', '.join(r for f in families() for r in f.hub_repos)}); pass --family NAME "
        f"(one of: {', '.join(names())}) to load another repo"
    )


__all__ = [
    "ModelFamily",
    "UnknownFamilyError",
    "check_foreign",
    "detect",
    "families",
    "get",
    "names",
    "option_owners",
    "register",
]
