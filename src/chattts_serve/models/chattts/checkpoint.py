"""The one place that knows the official ChatTTS checkpoint layout (Hugging Face ``2Noise/ChatTTS``)::

    asset/gpt/config.json, asset/gpt/model.safetensors    LLaMA trunk
    asset/Embed.safetensors                               embeddings + weight-normed heads
    asset/Decoder.safetensors                             hidden states -> mel
    asset/DVAE.safetensors                                codes <-> mel
    asset/Vocos.safetensors                               vocoder
    asset/tokenizer/{tokenizer.json, tokenizer_config.json, special_tokens_map.json}

``load`` reads a local directory (or downloads the repo with ``huggingface_hub``), builds every module
on the meta device and assigns the memory-mapped tensors, so the weights are never held twice.
``random_checkpoint.write_random`` writes a deterministic random-weight checkpoint in exactly this layout,
using the path constants defined here (this module does not import it: loading needs no generator).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ..hub import local_or_hub
from .config import DEFAULT_MODEL, ConvStackConfig, DecoderConfig, DVAEConfig, GPTConfig, ModelConfig, VocosConfig
from .dvae import DVAE, GFSQ, Decoder
from .embed import Embed, fold_weight_norm
from .gpt import GPT
from .vocos import Vocos

logger = logging.getLogger(__name__)

GPT_DIR = "asset/gpt"
GPT_CONFIG = "asset/gpt/config.json"
GPT_WEIGHTS = "asset/gpt/model.safetensors"
EMBED = "asset/Embed.safetensors"
DECODER = "asset/Decoder.safetensors"
DVAE_FILE = "asset/DVAE.safetensors"
VOCOS = "asset/Vocos.safetensors"
TOKENIZER_DIR = "asset/tokenizer"
REQUIRED_FILES = (
    GPT_CONFIG,
    GPT_WEIGHTS,
    EMBED,
    DECODER,
    DVAE_FILE,
    VOCOS,
    f"{TOKENIZER_DIR}/tokenizer.json",
)
# Optional, our own: speaker statistics for checkpoints whose hidden size is not the official 768.
SPK_STAT = "asset/spk_stat.txt"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or malformed. The message says what and where."""


@dataclass
class LoadedModel:
    """Every module of ChatTTS, loaded and in eval mode."""

    config: ModelConfig
    gpt: GPT
    embed: Embed
    decoder: Decoder
    dvae: DVAE
    vocos: Vocos
    root: Path


# --------------------------------------------------------------------------------------------------
# Locating the files


def resolve(path_or_repo: str | os.PathLike, revision: str | None = None) -> Path:
    """A local checkpoint directory, or a Hugging Face repo id downloaded (and cached) on demand."""
    return local_or_hub(
        path_or_repo,
        revision,
        required=REQUIRED_FILES,
        patterns=("asset/gpt/*", "asset/*.safetensors", "asset/tokenizer/*"),
        error=CheckpointError,
        kind="ChatTTS checkpoint directory (asset/)",
        offline_advice=lambda repo: (
            "Download the ChatTTS weights on a machine with internet access, e.g. "
            f"`huggingface-cli download {repo} --local-dir ./ChatTTS`, then pass that directory "
            "(--model ./ChatTTS). For a random-weight test checkpoint run `chattts-serve checkpoint random ./ckpt`."
        ),
    )


# --------------------------------------------------------------------------------------------------
# Reading tensors and dimensions


class _File:
    """A safetensors file opened lazily (memory-mapped); errors name the file and tensor."""

    def __init__(self, root: Path, rel: str) -> None:
        self.rel = rel
        try:
            self._f = safe_open(str(root / rel), framework="pt", device="cpu")
        except Exception as exc:
            raise CheckpointError(f"{rel}: cannot read safetensors file ({exc})") from None
        self.keys = set(self._f.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.keys:
            raise CheckpointError(f"{self.rel}: missing tensor {name!r}")
        return tuple(self._f.get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        if name not in self.keys:
            raise CheckpointError(f"{self.rel}: missing tensor {name!r}")
        return self._f.get_tensor(name)

    def count(self, pattern: str) -> int:
        """Number of distinct indices i for keys matching ``pattern`` with ``{i}``."""
        rx = re.compile(re.escape(pattern).replace(r"\{i\}", r"(\d+)"))
        found = {int(m.group(1)) for k in self.keys if (m := rx.fullmatch(k))}
        if found and found != set(range(len(found))):
            raise CheckpointError(f"{self.rel}: non-contiguous indices for {pattern}: {sorted(found)}")
        return len(found)


def _stack_config(f: _File, prefix: str) -> ConvStackConfig:
    bn, idim, _ = f.shape(f"{prefix}.conv_in.0.weight")
    hidden = f.shape(f"{prefix}.conv_in.2.weight")[0]
    odim = f.shape(f"{prefix}.conv_out.weight")[0]
    n = f.count(f"{prefix}.decoder_block.{{i}}.dwconv.weight")
    kernel = f.shape(f"{prefix}.decoder_block.0.dwconv.weight")[-1] if n else 7
    return ConvStackConfig(idim=idim, odim=odim, hidden=hidden, num_layers=n, bn_dim=bn, kernel=kernel)


def _gpt_config(root: Path, f: _File) -> GPTConfig:
    try:
        raw = json.loads((root / GPT_CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{GPT_CONFIG}: cannot parse ({exc})") from None
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        return GPTConfig(
            hidden_size=hidden,
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            intermediate_size=int(raw["intermediate_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 1e4))),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            num_audio_tokens=int(raw.get("num_audio_tokens", 626)),
            num_text_tokens=int(raw.get("num_text_tokens", 21178)),
            num_vq=int(raw.get("num_vq", 4)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{GPT_CONFIG}: bad or missing field ({exc})") from None


def read_config(root: Path, files: dict[str, _File] | None = None) -> ModelConfig:
    """Model dimensions from config.json and the tensor shapes of each file."""
    files = files or _open_all(root)
    gpt = _gpt_config(root, files[GPT_WEIGHTS])
    dec = _stack_config(files[DECODER], "decoder")
    dv = files[DVAE_FILE]
    groups = dv.count("vq_layer.quantizer.rvqs.{i}.project_in.weight")
    d, group_dim = dv.shape("vq_layer.quantizer.rvqs.0.project_in.weight")
    dvae = DVAEConfig(
        decoder=_stack_config(dv, "decoder"),
        encoder=_stack_config(dv, "encoder"),
        vq_dim=group_dim * groups,
        levels=(5,) * d,
        groups=groups,
    )
    vo = files[VOCOS]
    vocos = VocosConfig(
        dim=vo.shape("backbone.embed.weight")[0],
        intermediate_dim=vo.shape("backbone.convnext.0.pwconv1.weight")[0],
        num_layers=vo.count("backbone.convnext.{i}.dwconv.weight"),
    )
    return ModelConfig(gpt=gpt, decoder=DecoderConfig(dec), dvae=dvae, vocos=vocos)


def _open_all(root: Path) -> dict[str, _File]:
    return {rel: _File(root, rel) for rel in (GPT_WEIGHTS, EMBED, DECODER, DVAE_FILE, VOCOS)}


# --------------------------------------------------------------------------------------------------
# Loading


def _assign(
    module: nn.Module,
    f: _File,
    dtype: torch.dtype,
    device: torch.device,
    transform: Callable[[_File], dict[str, torch.Tensor]] | None = None,
    ignore: tuple[str, ...] = (),
) -> None:
    """Strictly assign a file's tensors to a meta-device module, checking names and shapes."""
    expected = module.state_dict(keep_vars=True)
    tensors = transform(f) if transform else {k: f.get(k) for k in f.keys if k not in ignore}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        raise CheckpointError(f"{f.rel}: missing tensor(s) {', '.join(missing[:8])}")
    if unexpected:
        raise CheckpointError(f"{f.rel}: unexpected tensor(s) {', '.join(unexpected[:8])}")
    state = {}
    for name, ref in expected.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(ref.shape):
            raise CheckpointError(f"{f.rel}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(ref.shape)}")
        if not t.is_floating_point():
            raise CheckpointError(f"{f.rel}: tensor {name!r} has dtype {t.dtype}, expected a float type")
        state[name] = t.to(device=device, dtype=dtype)
    module.load_state_dict(state, strict=True, assign=True)


def _embed_tensors(f: _File, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    out = {k: f.get(k) for k in f.keys if not k.startswith(("head_text.", "head_code."))}
    g, v = "parametrizations.weight.original0", "parametrizations.weight.original1"

    def folded(prefix: str, rows: int) -> torch.Tensor:
        # torch._weight_norm checks nothing: validate shapes first (a bad file must not crash us).
        for name, shape in ((f"{prefix}.{g}", (rows, 1)), (f"{prefix}.{v}", (rows, cfg.hidden_size))):
            if f.shape(name) != shape:
                raise CheckpointError(f"{f.rel}: tensor {name!r} has shape {f.shape(name)}, expected {shape}")
        return fold_weight_norm(f.get(f"{prefix}.{g}").float(), f.get(f"{prefix}.{v}").float())

    out["head_text"] = folded("head_text", cfg.num_text_tokens)
    out["head_code"] = torch.stack([folded(f"head_code.{q}", cfg.num_audio_tokens) for q in range(cfg.num_vq)])
    return out


def load(
    path_or_repo: str | os.PathLike = DEFAULT_MODEL,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    revision: str | None = None,
) -> LoadedModel:
    """Load every module. ``dtype`` applies to the GPT trunk; embeddings, heads, Decoder, DVAE and
    Vocos stay in fp32 (as in the reference: they are small and precision-sensitive)."""
    root = resolve(path_or_repo, revision)
    device = torch.device(device)
    files = _open_all(root)
    cfg = read_config(root, files)
    with torch.device("meta"):
        gpt, embed = GPT(cfg.gpt), Embed(cfg.gpt)
        decoder, dvae, vocos = Decoder(cfg.decoder), DVAE(cfg.dvae), Vocos(cfg.vocos)
    _assign(gpt, files[GPT_WEIGHTS], dtype, device, ignore=("embed_tokens.weight",))
    _assign(embed, files[EMBED], torch.float32, device, transform=lambda f: _embed_tensors(f, cfg.gpt))
    _assign(decoder, files[DECODER], torch.float32, device)
    _assign(dvae, files[DVAE_FILE], torch.float32, device)
    _assign(vocos, files[VOCOS], torch.float32, device)
    # Non-persistent buffers (not in the files) are rebuilt on the target device.
    gpt.init_buffers(device)
    for m in dvae.modules():
        if isinstance(m, GFSQ):
            m.init_buffers(device)
    for m in (gpt, embed, decoder, dvae, vocos):
        m.eval().requires_grad_(False)
    return LoadedModel(cfg, gpt, embed, decoder, dvae, vocos, root)


def read_speaker_stats(root: Path, hidden_size: int | None = None):
    """The checkpoint's speaker statistics: its own ``asset/spk_stat.txt`` if present, else the official
    768-dim ones shipped with the package; None when neither fits ``hidden_size``."""
    from .speaker import SpeakerStats, default_speaker_stats

    custom = Path(root) / SPK_STAT
    if custom.is_file():
        stats = SpeakerStats.from_string(custom.read_text().strip())
        if hidden_size is not None and stats.dim != hidden_size:
            raise CheckpointError(f"{SPK_STAT}: {stats.dim}-dim statistics for a {hidden_size}-dim model")
        return stats
    stats = default_speaker_stats()
    return stats if hidden_size in (None, stats.dim) else None
