"""Finding and loading a VITS checkpoint in the Hugging Face ``VitsModel`` layout (e.g. MMS-TTS).

A checkpoint directory holds ``config.json`` (``model_type`` "vits"), ``model.safetensors``, ``vocab.json`` and
``tokenizer_config.json`` (plus ``special_tokens_map.json`` and ``added_tokens.json``, which we do not need).

The MMS-TTS weights (``facebook/mms-tts-*``) are CC-BY-NC 4.0: non-commercial use only.

The load is strict: a missing or unexpected tensor, or a shape the config does not give, is an error that
names it. The WaveNet convolutions (flow, posterior encoder) are stored as weight-norm pairs: the hub's files
(written by transformers 4.33) name them ``X.weight_g``/``X.weight_v``, transformers 5 writes
``X.parametrizations.weight.original0``/``original1``; both are read and folded into ``X.weight`` once, with the
kernel transformers' weight-norm calls on every forward (``torch._weight_norm``), so the weight is its own bit
for bit. The posterior encoder (training only) is checked, then freed.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..hub import checkpoint_config, local_or_hub
from .config import ConfigError, VitsConfig
from .flow import WNConv1d
from .model import VitsModel

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
VOCAB_FILE = "vocab.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
ADDED_TOKENS_FILE = "added_tokens.json"
VITS_FILES = (CONFIG_FILE, WEIGHTS_FILE, VOCAB_FILE, TOKENIZER_CONFIG_FILE)
HUB_PATTERNS = [CONFIG_FILE, WEIGHTS_FILE, VOCAB_FILE, TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_FILE, ADDED_TOKENS_FILE]
LICENSE_NOTE = "MMS-TTS weights (facebook/mms-tts-*) are licensed CC-BY-NC 4.0: non-commercial use only."

_G, _V = ".weight_g", ".weight_v"
_P0, _P1 = ".parametrizations.weight.original0", ".parametrizations.weight.original1"


class CheckpointError(RuntimeError):
    """A VITS checkpoint is missing, incomplete or malformed. The message says what and where."""


def is_vits_dir(path: str | os.PathLike) -> bool:
    """A directory with the safetensors weights and a config.json whose model_type is "vits" (reads no weights)."""
    raw = checkpoint_config(path, CONFIG_FILE, WEIGHTS_FILE)
    return raw is not None and raw.get("model_type") == "vits"


def resolve(path_or_repo: str | os.PathLike, revision: str | None = None) -> Path:
    """A local checkpoint directory, or a Hugging Face repo id (e.g. facebook/mms-tts-eng) fetched on demand."""
    return local_or_hub(
        path_or_repo,
        revision,
        required=VITS_FILES,
        patterns=HUB_PATTERNS,
        error=CheckpointError,
        kind="VITS checkpoint directory",
        offline_advice=lambda repo: (
            "Download the VITS checkpoint on a machine with internet access, e.g. "
            f"`huggingface-cli download {repo} --local-dir ./{repo.split('/')[-1]}`, then pass that directory. "
            "For a random-weight test checkpoint run `chattts-serve checkpoint random --family vits DIR`. "
            + LICENSE_NOTE
        ),
    )


def hub_state_dict(model: VitsModel) -> dict[str, torch.Tensor]:
    """The model's weights named as the hub's files name them: weight-normed convolutions as ``weight_g`` (the
    per-output-channel norm) and ``weight_v`` (the weight itself: folding gives it back up to rounding)."""
    pairs = weight_normed(model)
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        base = key[: -len(".weight")] if key.endswith(".weight") else None
        if base in pairs:
            out[base + _G] = torch.norm_except_dim(value, 2, 0).contiguous().clone()
            out[base + _V] = value.contiguous().clone()
        else:
            out[key] = value.contiguous().clone()
    return out


def weight_normed(model: torch.nn.Module) -> set[str]:
    """State-dict prefixes of the convolutions stored as weight-norm pairs."""
    return {name for name, m in model.named_modules() if isinstance(m, WNConv1d)}


def load(root: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
         ) -> VitsModel:
    """Build the model from ``root``'s config.json and load model.safetensors strictly (weight norm folded)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = Path(root)
    try:
        config = VitsConfig.from_file(root / CONFIG_FILE)
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None
    path = root / WEIGHTS_FILE
    try:
        raw = load_file(path)
    except FileNotFoundError:
        raise CheckpointError(f"no {WEIGHTS_FILE} in {root}") from None
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({type(exc).__name__}: {exc})") from None
    model = VitsModel(config)
    state = fold_weight_norm(raw, str(path))
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s): {_some(missing)}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} tensor(s): {_some(unexpected)}")
        raise CheckpointError(f"{path} does not match its config.json: {'; '.join(parts)}")
    for key, value in state.items():
        if value.shape != expected[key].shape:
            raise CheckpointError(f"{path}: {key} has shape {tuple(value.shape)}, config.json gives "
                                  f"{tuple(expected[key].shape)}")
        if not value.is_floating_point():
            raise CheckpointError(f"{path}: {key} is {value.dtype}, expected a floating-point tensor")
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    model.drop_training_modules()
    return model.to(device=device, dtype=dtype).eval()


def fold_weight_norm(state: dict[str, torch.Tensor], where: str = "state dict") -> dict[str, torch.Tensor]:
    """Each weight-norm pair (either naming) as one ``X.weight`` = ``torch._weight_norm(v, g, 0)``."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        for g_suffix, v_suffix in ((_G, _V), (_P0, _P1)):
            if key.endswith(g_suffix):
                base = key[: -len(g_suffix)]
                v = state.get(base + v_suffix)
                if v is None:
                    raise CheckpointError(f"{where}: {key} has no matching {base + v_suffix}")
                if base + ".weight" in state:
                    raise CheckpointError(f"{where}: {base} has both a weight and a weight-norm pair")
                out[base + ".weight"] = torch._weight_norm(v.float(), value.float(), 0)
                break
            if key.endswith(v_suffix):
                base = key[: -len(v_suffix)]
                if base + g_suffix not in state:
                    raise CheckpointError(f"{where}: {key} has no matching {base + g_suffix}")
                break
        else:
            out[key] = value
    return out


def _some(keys: list[str], n: int = 8) -> str:
    return ", ".join(keys[:n]) + (" ..." if len(keys) > n else "")
