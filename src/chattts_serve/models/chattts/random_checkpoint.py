"""A deterministic random-weight ChatTTS checkpoint, written in the official layout that ``checkpoint`` reads.

Tests, benchmarks and the fidelity goldens run on these instead of the real weights: ``write_random`` with the
same size and seed always writes the same bytes (the goldens check the sha256 of every file). The weights are
scaled so a random model still behaves like a model: the residual stream stays O(1), the audio heads emit EOS
after a few hundred steps, and the vocoder's output is quiet and finite.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from .checkpoint import DECODER, DVAE_FILE, EMBED, GPT_CONFIG, GPT_DIR, GPT_WEIGHTS, SPK_STAT, TOKENIZER_DIR, VOCOS
from .config import NUM_MELS, ConvStackConfig, DecoderConfig, DVAEConfig, GPTConfig, ModelConfig, VocosConfig
from .mel import hann_window, mel_filterbank
from .synthetic_tokenizer import write_tokenizer


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
