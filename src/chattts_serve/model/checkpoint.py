"""The one place that knows the official ChatTTS checkpoint layout (Hugging Face ``2Noise/ChatTTS``)::

    asset/gpt/config.json, asset/gpt/model.safetensors    LLaMA trunk
    asset/Embed.safetensors                               embeddings + weight-normed heads
    asset/Decoder.safetensors                             hidden states -> mel
    asset/DVAE.safetensors                                codes <-> mel
    asset/Vocos.safetensors                               vocoder
    asset/tokenizer/{tokenizer.json, tokenizer_config.json, special_tokens_map.json}

``load`` reads a local directory (or downloads the repo with ``huggingface_hub``), builds every module
on the meta device and assigns the memory-mapped tensors, so the weights are never held twice.
``write_random`` writes a deterministic random-weight checkpoint in exactly this layout.
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
from safetensors.torch import save_file
from torch import nn

from .config import (
    NUM_MELS,
    ConvStackConfig,
    DecoderConfig,
    DVAEConfig,
    GPTConfig,
    ModelConfig,
    VocosConfig,
)
from .dvae import DVAE, GFSQ, Decoder
from .embed import Embed, fold_weight_norm
from .gpt import GPT
from .mel import hann_window, mel_filterbank
from .synthetic_tokenizer import write_tokenizer
from .vocos import Vocos

logger = logging.getLogger(__name__)

HF_REPO = "2Noise/ChatTTS"
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
    path = Path(path_or_repo).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{path} is a file; expected a checkpoint directory containing asset/")
        missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
        if missing:
            raise CheckpointError(f"checkpoint directory {path} is incomplete; missing: {', '.join(missing)}")
        return path
    repo = str(path_or_repo)
    if repo.startswith((".", "/", "~")) or not re.fullmatch(r"[\w.-]+/[\w.-]+", repo):
        raise CheckpointError(f"no checkpoint directory {str(path)!r} (and it is not a Hugging Face repo id)")
    return _download(repo, revision)


def _download(repo: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["asset/gpt/*", "asset/*.safetensors", "asset/tokenizer/*"]
    try:
        root = snapshot_download(repo_id=repo, revision=revision, allow_patterns=patterns)
    except Exception as exc:  # network, auth, offline mode: one clear message, no traceback
        raise CheckpointError(
            f"could not get the ChatTTS weights for {repo!r} ({type(exc).__name__}: {exc}). "
            "Download them on a machine with internet access, e.g. "
            f"`huggingface-cli download {repo} --local-dir ./ChatTTS`, then pass that directory "
            "(--model ./ChatTTS). For a random-weight test checkpoint run "
            "`chattts-serve checkpoint random ./ckpt`."
        ) from None
    return resolve(root)


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
    path_or_repo: str | os.PathLike = HF_REPO,
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


# --------------------------------------------------------------------------------------------------
# Writing random checkpoints


def _gpt_state(cfg: GPTConfig, g: torch.Generator) -> dict[str, torch.Tensor]:
    h, inter = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_kv_heads * cfg.head_dim
    # Scaled so the residual stream stays O(1) over all layers.
    out_scale = 1.0 / (2 * cfg.num_layers) ** 0.5
    sd: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes = {
            "self_attn.q_proj.weight": ((h, h), 1.0),
            "self_attn.k_proj.weight": ((kv, h), 1.0),
            "self_attn.v_proj.weight": ((kv, h), 1.0),
            "self_attn.o_proj.weight": ((h, h), out_scale),
            "mlp.gate_proj.weight": ((inter, h), 1.0),
            "mlp.up_proj.weight": ((inter, h), 1.0),
            "mlp.down_proj.weight": ((h, inter), out_scale),
        }
        for name, (shape, scale) in shapes.items():
            sd[p + name] = torch.randn(shape, generator=g) * (scale / shape[1] ** 0.5)
        sd[p + "input_layernorm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=g)
        sd[p + "post_attention_layernorm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=g)
    sd["norm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=g)
    return sd


def _embed_state(cfg: GPTConfig, g: torch.Generator) -> dict[str, torch.Tensor]:
    h = cfg.hidden_size
    gn, vn = "parametrizations.weight.original0", "parametrizations.weight.original1"
    sd = {f"emb_code.{q}.weight": torch.randn(cfg.num_audio_tokens, h, generator=g) * 0.5 for q in range(cfg.num_vq)}
    sd["emb_text.weight"] = torch.randn(cfg.num_text_tokens, h, generator=g)
    sd[f"head_text.{gn}"] = 1.0 + 0.2 * torch.rand(cfg.num_text_tokens, 1, generator=g)
    sd[f"head_text.{vn}"] = torch.randn(cfg.num_text_tokens, h, generator=g)
    for q in range(cfg.num_vq):
        # With these scales a full-size random model emits EOS after a few hundred steps (~5-10 s).
        sd[f"head_code.{q}.{gn}"] = 1.0 + 0.2 * torch.rand(cfg.num_audio_tokens, 1, generator=g)
        sd[f"head_code.{q}.{vn}"] = torch.randn(cfg.num_audio_tokens, h, generator=g)
    return sd


def _conv(g: torch.Generator, out_c: int, in_c: int, k: int, bias: bool = True) -> tuple:
    w = torch.randn(out_c, in_c, k, generator=g) / (in_c * k) ** 0.5
    return w, (0.02 * torch.randn(out_c, generator=g) if bias else None)


def _stack_state(cfg: ConvStackConfig, g: torch.Generator, prefix: str) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for name, (o, i) in {"conv_in.0": (cfg.bn_dim, cfg.idim), "conv_in.2": (cfg.hidden, cfg.bn_dim)}.items():
        sd[f"{prefix}.{name}.weight"], sd[f"{prefix}.{name}.bias"] = _conv(g, o, i, 3)
    for b in range(cfg.num_layers):
        sd.update(_convnext_state(cfg.hidden, cfg.hidden * 4, cfg.kernel, g, f"{prefix}.decoder_block.{b}", "weight"))
    sd[f"{prefix}.conv_out.weight"] = _conv(g, cfg.odim, cfg.hidden, 1, bias=False)[0]
    return sd


def _convnext_state(dim: int, inter: int, kernel: int, g: torch.Generator, p: str, scale_name: str) -> dict:
    return {
        f"{p}.dwconv.weight": torch.randn(dim, 1, kernel, generator=g) / kernel**0.5,
        f"{p}.dwconv.bias": 0.02 * torch.randn(dim, generator=g),
        f"{p}.norm.weight": 1.0 + 0.1 * torch.randn(dim, generator=g),
        f"{p}.norm.bias": 0.02 * torch.randn(dim, generator=g),
        f"{p}.pwconv1.weight": torch.randn(inter, dim, generator=g) / dim**0.5,
        f"{p}.pwconv1.bias": 0.02 * torch.randn(inter, generator=g),
        f"{p}.pwconv2.weight": torch.randn(dim, inter, generator=g) / inter**0.5,
        f"{p}.pwconv2.bias": 0.02 * torch.randn(dim, generator=g),
        f"{p}.{scale_name}": 0.1 + 0.05 * torch.rand(dim, generator=g),
    }


def _coef(g: torch.Generator) -> torch.Tensor:
    return (0.5 + torch.rand(1, NUM_MELS, 1, generator=g)).contiguous()


def _decoder_state(cfg: DecoderConfig, g: torch.Generator) -> dict[str, torch.Tensor]:
    sd = {"coef": _coef(g)}
    sd.update(_stack_state(cfg.stack, g, "decoder"))
    sd["out_conv.weight"] = _conv(g, NUM_MELS, cfg.stack.odim, 3, bias=False)[0]
    return sd


def _dvae_state(cfg: DVAEConfig, g: torch.Generator) -> dict[str, torch.Tensor]:
    sd = {"coef": _coef(g)}
    sd["downsample_conv.0.weight"], sd["downsample_conv.0.bias"] = _conv(g, cfg.dim, NUM_MELS, 3)
    sd["downsample_conv.2.weight"], sd["downsample_conv.2.bias"] = _conv(g, cfg.dim, cfg.dim, 4)
    sd["preprocessor_mel.mel_spec.spectrogram.window"] = hann_window()
    sd["preprocessor_mel.mel_spec.mel_scale.fb"] = mel_filterbank()
    sd.update(_stack_state(cfg.encoder, g, "encoder"))
    sd.update(_stack_state(cfg.decoder, g, "decoder"))
    sd["out_conv.weight"] = _conv(g, NUM_MELS, cfg.dim, 3, bias=False)[0]
    d, group_dim = len(cfg.levels), cfg.vq_dim // cfg.groups
    for i in range(cfg.groups):
        p = f"vq_layer.quantizer.rvqs.{i}"
        sd[f"{p}.project_in.weight"] = torch.randn(d, group_dim, generator=g) / group_dim**0.5
        sd[f"{p}.project_in.bias"] = 0.02 * torch.randn(d, generator=g)
        sd[f"{p}.project_out.weight"] = torch.randn(group_dim, d, generator=g) / d**0.5
        sd[f"{p}.project_out.bias"] = 0.02 * torch.randn(group_dim, generator=g)
    return sd


def _vocos_state(cfg: VocosConfig, g: torch.Generator) -> dict[str, torch.Tensor]:
    sd = {
        "feature_extractor.mel_spec.spectrogram.window": hann_window(),
        "feature_extractor.mel_spec.mel_scale.fb": mel_filterbank(),
    }
    sd["backbone.embed.weight"], sd["backbone.embed.bias"] = _conv(g, cfg.dim, NUM_MELS, 7)
    sd["backbone.norm.weight"] = 1.0 + 0.1 * torch.randn(cfg.dim, generator=g)
    sd["backbone.norm.bias"] = 0.02 * torch.randn(cfg.dim, generator=g)
    for b in range(cfg.num_layers):
        sd.update(_convnext_state(cfg.dim, cfg.intermediate_dim, 7, g, f"backbone.convnext.{b}", "gamma"))
    sd["backbone.final_layer_norm.weight"] = 1.0 + 0.1 * torch.randn(cfg.dim, generator=g)
    sd["backbone.final_layer_norm.bias"] = 0.02 * torch.randn(cfg.dim, generator=g)
    out_w = torch.randn(1026, cfg.dim, generator=g) / cfg.dim**0.5
    out_b = 0.1 * torch.randn(1026, generator=g)
    out_b[:513] -= 4.0  # log-magnitudes around e^-4: quiet, finite audio
    sd["head.out.weight"], sd["head.out.bias"] = out_w, out_b
    sd["head.istft.window"] = hann_window()
    return sd


def _gpt_config_json(cfg: GPTConfig) -> dict:
    return {
        "architectures": ["LlamaModel"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "num_hidden_layers": cfg.num_layers,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "vocab_size": 32000,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pretraining_tp": 1,
        "torch_dtype": "float32",
        "use_cache": False,
        "spk_emb_dim": 192,
        "spk_KL": False,
        "num_audio_tokens": cfg.num_audio_tokens,
        "num_text_tokens": cfg.num_text_tokens,
        "num_vq": cfg.num_vq,
    }


def write_random(
    directory: str | os.PathLike,
    size: str | ModelConfig = "tiny",
    seed: int = 0,
) -> Path:
    """Write a deterministic random-weight checkpoint in the official layout; returns its root.

    ``size`` is "tiny" (unit tests, a few MB), "full" (official dimensions, ~1.1 GB fp32), or a
    ``ModelConfig``. The same seed always gives the same bytes.
    """
    if isinstance(size, ModelConfig):
        cfg = size
    elif size in ("tiny", "full"):
        cfg = ModelConfig.tiny() if size == "tiny" else ModelConfig.full()
    else:
        raise ValueError(f"size must be 'tiny', 'full' or a ModelConfig, got {size!r}")
    root = Path(directory)
    (root / GPT_DIR).mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    # One metadata key only: safetensors writes metadata in hash-map order, and a second key would
    # make the bytes (and so the sha256 the reference checks) differ from run to run.
    meta = {"format": "pt"}

    def save(sd: dict[str, torch.Tensor], rel: str) -> None:
        save_file({k: v.float().contiguous() for k, v in sd.items()}, str(root / rel), metadata=meta)

    save(_gpt_state(cfg.gpt, g), GPT_WEIGHTS)
    (root / GPT_CONFIG).write_text(json.dumps(_gpt_config_json(cfg.gpt), indent=2) + "\n")
    save(_embed_state(cfg.gpt, g), EMBED)
    save(_decoder_state(cfg.decoder, g), DECODER)
    save(_dvae_state(cfg.dvae, g), DVAE_FILE)
    save(_vocos_state(cfg.vocos, g), VOCOS)
    write_tokenizer(root / TOKENIZER_DIR)
    if cfg.gpt.hidden_size != 768:
        from .speaker import SpeakerStats

        std = 1.0 + 2.0 * torch.rand(cfg.gpt.hidden_size, generator=g)
        mean = 2.0 * torch.randn(cfg.gpt.hidden_size, generator=g)
        (root / SPK_STAT).write_text(SpeakerStats(std.half(), mean.half()).to_string() + "\n")
    return root
