"""Finding and loading a Kokoro checkpoint in the official hexgrad/Kokoro-82M layout.

``config.json``; ``kokoro-v1_0.pth``, a dict of five state dicts (``bert``, ``bert_encoder``,
``predictor``, ``decoder``, ``text_encoder``) whose keys carry DataParallel's ``module.`` prefix and
whose weight-normed convolutions are stored as ``weight_g``/``weight_v`` pairs; ``voices/NAME.pt``.

The load is strict, unlike the package's (which retries with ``strict=False`` and so lets a missing
tensor pass silently): a missing or unexpected key is an error that names it. The only tensors allowed
to be absent are the instance norms' affine parameters, which the official file does not carry (the
package leaves them at 1 and 0, and so do we).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from ..hub import checkpoint_config, local_or_hub
from .config import KokoroConfig
from .layers import weight_normed
from .model import KokoroModel

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "kokoro-v1_0.pth"
VOICES_DIR = "voices"
KOKORO_FILES = (CONFIG_FILE, WEIGHTS_FILE)
COMPONENTS = ("bert", "bert_encoder", "predictor", "decoder", "text_encoder")
PREFIX = "module."
HUB_PATTERNS = [CONFIG_FILE, WEIGHTS_FILE, f"{VOICES_DIR}/*.pt"]
_OPTIONAL = re.compile(r"(^|\.)norm\.(weight|bias)$")  # AdaIN's instance-norm affine (see the docstring)


class CheckpointError(RuntimeError):
    """A Kokoro checkpoint is missing, incomplete or malformed. The message says what and where."""


def is_kokoro_dir(path: str | os.PathLike) -> bool:
    """A directory with Kokoro's weights file and a config.json that has Kokoro's sections."""
    raw = checkpoint_config(path, CONFIG_FILE, WEIGHTS_FILE)
    return raw is not None and {"istftnet", "plbert", "vocab"} <= raw.keys()


def resolve(path_or_repo: str | os.PathLike, revision: str | None = None) -> Path:
    """A local checkpoint directory, or a Hugging Face repo id (e.g. hexgrad/Kokoro-82M) fetched on demand."""
    return local_or_hub(
        path_or_repo,
        revision,
        required=KOKORO_FILES,
        patterns=HUB_PATTERNS,
        error=CheckpointError,
        kind="Kokoro checkpoint directory",
        offline_advice=lambda repo: (
            "Download the Kokoro weights on a machine with internet access, e.g. "
            f"`huggingface-cli download {repo} --local-dir ./Kokoro-82M`, then pass that directory. "
            "For a random-weight test checkpoint run `chattts-serve checkpoint random --family kokoro DIR`."
        ),
    )


def official_state_dicts(model: KokoroModel) -> dict[str, dict[str, torch.Tensor]]:
    """The model's weights in the official file's layout: five state dicts, ``module.`` keys, weight
    norm stored as pairs (``weight_g`` the per-output-channel norm, ``weight_v`` the direction: here the
    weight itself, so folding them back gives it exactly up to the division's rounding)."""
    out = {}
    for name in COMPONENTS:
        component = getattr(model, name)
        pairs = {f"{p}.weight" for p in weight_normed(component)}
        sd: dict[str, torch.Tensor] = {}
        for key, value in component.state_dict().items():
            if _OPTIONAL.search(key):
                continue
            if key in pairs:
                base = key[: -len("weight")]
                sd[PREFIX + base + "weight_g"] = torch.norm_except_dim(value, 2, 0).clone()
                sd[PREFIX + base + "weight_v"] = value.clone()
            else:
                sd[PREFIX + key] = value.clone()
        out[name] = sd
    return out


def load(root: str | os.PathLike, device: str | torch.device = "cpu") -> KokoroModel:
    """Build the model from ``root``'s config.json and load kokoro-v1_0.pth strictly (weight norm folded)."""
    root = Path(root)
    config = KokoroConfig.from_file(root / CONFIG_FILE)
    model = KokoroModel(config)
    path = root / WEIGHTS_FILE
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"no {WEIGHTS_FILE} in {root}") from None
    except Exception as exc:
        raise CheckpointError(f"{path}: not a readable torch file ({type(exc).__name__}: {exc})") from None
    if not isinstance(blob, dict) or set(blob) != set(COMPONENTS):
        found = sorted(blob) if isinstance(blob, dict) else type(blob).__name__
        raise CheckpointError(f"{path}: expected a dict of the state dicts {list(COMPONENTS)}, found {found}")
    for name in COMPONENTS:
        _load_component(getattr(model, name), blob[name], f"{path}[{name!r}]")
    return model.to(device).eval()


def _load_component(module: torch.nn.Module, raw: dict[str, torch.Tensor], where: str) -> None:
    state = fold_weight_norm({k.removeprefix(PREFIX): v for k, v in raw.items()}, where)
    expected = module.state_dict()
    missing = [k for k in expected if k not in state and not _OPTIONAL.search(k)]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} key(s): {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} key(s): {', '.join(unexpected[:8])}"
                         f"{' ...' if len(unexpected) > 8 else ''}")
        raise CheckpointError(f"{where} does not match the config: {'; '.join(parts)}")
    for key, value in state.items():
        if value.shape != expected[key].shape:
            raise CheckpointError(f"{where}: {key} has shape {tuple(value.shape)}, the config needs "
                                  f"{tuple(expected[key].shape)}")
    module.load_state_dict(state, strict=False)


def fold_weight_norm(state: dict[str, torch.Tensor], where: str = "state dict") -> dict[str, torch.Tensor]:
    """Each ``X.weight_g``/``X.weight_v`` pair as one ``X.weight``, computed by the kernel the package's
    weight-norm hook calls on every forward (``torch._weight_norm`` over dim 0), so the weight is the
    package's bit for bit."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.endswith(".weight_g"):
            base = key[: -len("_g")]
            v = state.get(base + "_v")
            if v is None:
                raise CheckpointError(f"{where}: {key} has no matching {base}_v")
            out[base] = torch._weight_norm(v.float(), value.float(), 0)
        elif key.endswith(".weight_v"):
            if key[: -len("_v")] + "_g" not in state:
                raise CheckpointError(f"{where}: {key} has no matching {key[:-len('_v')]}_g")
        else:
            out[key] = value
    return out
