"""A random-weight VITS checkpoint in the exact hub layout of an MMS-TTS checkpoint, for tests and benchmarks.

``write_random(dir, size, seed)`` writes what ``facebook/mms-tts-eng`` ships: ``config.json`` (every field
transformers 4.33 wrote, sorted as it sorts them; ``full``: the MMS-TTS sizes, ``tiny``: small ones),
``model.safetensors`` (float32; the WaveNet convolutions as ``weight_g``/``weight_v`` pairs, as the hub's files
name them; the posterior encoder included), ``vocab.json`` (the English MMS vocabulary: 38 characters),
``tokenizer_config.json``, ``special_tokens_map.json`` and ``added_tokens.json``.

Weights are initialised as transformers initialises a ``VitsModel`` (normal linears and embeddings, Kaiming
convolutions, zero element-wise affines), seeded. Two changes make the random model's output usable:

- the decoder's last convolution is scaled by ``CONV_POST_SCALE`` (0.002). Random weights drive HiFi-GAN's
  final tanh into saturation (99.95 % of samples at +-1), where a comparison is blind: any two models agree on
  a saturated sample. Scaled, the waveform peaks near 0.25 and every sample carries the network's value (we
  scale the decoder rather than compare before the tanh, so the test compares the very output users get);
- the duration flow's element-wise affine (the last step of its reverse pass) divides the log-durations by
  3 (``log_scale`` of the duration channel = ln 3). Random spline couplings push log-durations to the tails
  (+-5: a token lasting 1 or ~150 frames); divided by 3, a token lasts 1 to 6 frames, as speech does.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from .checkpoint import (
    ADDED_TOKENS_FILE,
    CONFIG_FILE,
    SPECIAL_TOKENS_FILE,
    TOKENIZER_CONFIG_FILE,
    VOCAB_FILE,
    WEIGHTS_FILE,
    hub_state_dict,
)
from .config import VitsConfig
from .duration import ElementwiseAffine, StochasticDurationPredictor
from .model import VitsModel
from .text_encoder import RelativeAttention

Size = Literal["tiny", "full"]
CONV_POST_SCALE = 0.002
LOG_DURATION_SCALE = math.log(3.0)

# facebook/mms-tts-eng's vocab.json (id 0, "k", doubles as the blank the tokenizer interleaves).
MMS_ENG_VOCAB = {
    "k": 0, "'": 1, "z": 2, "y": 3, "u": 4, "d": 5, "h": 6, "e": 7, "s": 8, "w": 9, "–": 10, "3": 11, "c": 12,
    "p": 13, "-": 14, "1": 15, "j": 16, "m": 17, "i": 18, " ": 19, "f": 20, "l": 21, "o": 22, "0": 23, "b": 24,
    "r": 25, "a": 26, "4": 27, "2": 28, "n": 29, "_": 30, "x": 31, "v": 32, "t": 33, "q": 34, "5": 35, "6": 36,
    "g": 37,
}
TOKENIZER_CONFIG: dict[str, Any] = {
    "add_blank": True,
    "clean_up_tokenization_spaces": True,
    "is_uroman": False,
    "language": "eng",
    "model_max_length": 1000000000000000019884624838656,
    "normalize": True,
    "pad_token": "k",
    "phonemize": False,
    "tokenizer_class": "VitsTokenizer",
    "unk_token": "<unk>",
}
SPECIAL_TOKENS = {"pad_token": "k", "unk_token": "<unk>"}
# Fields transformers 4.33 adds to every config.json it writes.
CONFIG_EXTRAS = {"architectures": ["VitsModel"], "model_type": "vits", "torch_dtype": "float32",
                 "transformers_version": "4.33.0.dev0"}

TINY = dict(
    hidden_size=16, num_hidden_layers=2, num_attention_heads=2, ffn_dim=32, flow_size=16, spectrogram_bins=17,
    upsample_initial_channel=32, upsample_rates=(4, 4), upsample_kernel_sizes=(8, 8), resblock_kernel_sizes=(3, 5),
    resblock_dilation_sizes=((1, 3), (1, 3)), duration_predictor_flow_bins=4, duration_predictor_num_flows=2,
    duration_predictor_filter_channels=32, prior_encoder_num_flows=2, prior_encoder_num_wavenet_layers=2,
    posterior_encoder_num_wavenet_layers=2, sampling_rate=16000,
)


def config_for(size: Size, **overrides: Any) -> VitsConfig:
    if size not in ("tiny", "full"):
        raise ValueError(f"size must be 'tiny' or 'full', got {size!r}")
    fields = dict(TINY) if size == "tiny" else {}
    fields.update(overrides)
    fields.setdefault("vocab_size", len(MMS_ENG_VOCAB))
    config = VitsConfig(**fields)
    config.validate(f"{size} config")
    return config


def random_model(config: VitsConfig, seed: int) -> VitsModel:
    """Our model with seeded weights, initialised as transformers' ``VitsPreTrainedModel._init_weights``."""
    torch.manual_seed(seed)
    model = VitsModel(config)
    std = config.initializer_range
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, std)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, std)
                if module.padding_idx is not None:
                    module.weight[module.padding_idx].zero_()
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()
            elif isinstance(module, (nn.Conv1d, nn.ConvTranspose1d)):
                nn.init.kaiming_normal_(module.weight)
                if module.bias is not None:
                    k = math.sqrt(module.groups / (module.in_channels * module.kernel_size[0]))
                    module.bias.uniform_(-k, k)
            elif isinstance(module, RelativeAttention) and config.window_size:
                module.emb_rel_k.normal_(0.0, config.head_dim**-0.5)
                module.emb_rel_v.normal_(0.0, config.head_dim**-0.5)
            elif isinstance(module, ElementwiseAffine):
                module.translate.zero_()
                module.log_scale.zero_()
        model.decoder.conv_post.weight.mul_(CONV_POST_SCALE)
        if isinstance(model.duration_predictor, StochasticDurationPredictor):
            model.duration_predictor.flows[0].log_scale[0].fill_(LOG_DURATION_SCALE)
    return model.eval()


def write_random(directory: str | os.PathLike, size: Size = "tiny", seed: int = 0, **overrides: Any) -> Path:
    """Write a random checkpoint to ``directory`` (created) and return it; ``overrides`` change config fields
    (e.g. ``num_speakers=3, speaker_embedding_size=8`` for a multi-speaker one). Same seed, same bytes."""
    from safetensors.torch import save_file

    config = config_for(size, **overrides)
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    raw = {**config.to_dict(), **CONFIG_EXTRAS}
    _write_json(root / CONFIG_FILE, dict(sorted(raw.items())))
    save_file(hub_state_dict(random_model(config, seed)), root / WEIGHTS_FILE, metadata={"format": "pt"})
    _write_json(root / VOCAB_FILE, dict(sorted(MMS_ENG_VOCAB.items())))
    _write_json(root / TOKENIZER_CONFIG_FILE, TOKENIZER_CONFIG)
    _write_json(root / SPECIAL_TOKENS_FILE, SPECIAL_TOKENS)
    _write_json(root / ADDED_TOKENS_FILE, {"<unk>": len(MMS_ENG_VOCAB)})
    return root


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
