"""A random-weight Kokoro checkpoint in the exact official layout, for tests and benchmarks offline.

``write_random(dir, size, seed)`` writes what hexgrad/Kokoro-82M ships: ``config.json`` (``full``: the
public file itself; ``tiny``: the same fields with the optional sizes shrunk), ``kokoro-v1_0.pth`` (five
float32 state dicts, ``module.``-prefixed keys, weight-norm pairs) and ``voices/NAME.pt`` (float32
[510, 1, 256]; every official voice name for ``full``, a few for ``tiny``).

Random durations are absurd without care: the duration head sums ``max_dur`` (50) sigmoids, so random
logits near 0 give ~25 frames a phoneme. We bias the duration projection by ``DURATION_BIAS`` (-3), so a
phoneme lasts round(50 * sigmoid(-3)) ~ 2-3 frames (50-75 ms), as real speech does. Likewise the F0
head is biased to ~150 Hz, so frames are voiced and the sine source runs as it does on real weights.

``tiny`` keeps every field and name and shrinks the sizes: ALBERT's, the number of text/duration layers,
``hidden_dim``, the generator's channels and resblocks, and the decoder's widths (``decoder_dim``,
``asr_res_dim``: two fields the official file does not carry, config.py). About 1.7M parameters instead of
81.8M, so the fast tier runs it in seconds. The package hard-codes the decoder's widths, so it loads a tiny
checkpoint only with its ``Decoder`` built at those widths (scripts/kokoro_reference_oracle.py does that,
with the package's own modules). The voice packs keep the official [510, 1, 256] (``style_dim`` 128).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from .checkpoint import CONFIG_FILE, VOICES_DIR, WEIGHTS_FILE, official_state_dicts
from .config import OFFICIAL_CONFIG, KokoroConfig
from .model import KokoroModel
from .voices import PACK_ROWS

DURATION_BIAS = -3.0
DURATION_WEIGHT_STD = 0.1  # enough spread that phonemes differ (1 to ~6 frames), not all the same length
F0_BIAS = 150.0  # Hz: random F0 near 0 would leave every frame unvoiced and the sine source unexercised
# The 54 voices of hexgrad/Kokoro-82M v1.0 (voices/*.pt).
OFFICIAL_VOICES = (
    "af_alloy", "af_aoede", "af_bella", "af_heart", "af_jessica", "af_kore", "af_nicole", "af_nova",
    "af_river", "af_sarah", "af_sky", "am_adam", "am_echo", "am_eric", "am_fenrir", "am_liam", "am_michael",
    "am_onyx", "am_puck", "am_santa", "bf_alice", "bf_emma", "bf_isabella", "bf_lily", "bm_daniel", "bm_fable",
    "bm_george", "bm_lewis", "ef_dora", "em_alex", "em_santa", "ff_siwis", "hf_alpha", "hf_beta", "hm_omega",
    "hm_psi", "if_sara", "im_nicola", "jf_alpha", "jf_gongitsune", "jf_nezumi", "jf_tebukuro", "jm_kumo",
    "pf_dora", "pm_alex", "pm_santa", "zf_xiaobei", "zf_xiaoni", "zf_xiaoxiao", "zf_xiaoyi", "zm_yunjian",
    "zm_yunxi", "zm_yunxia", "zm_yunyang",
)
TINY_VOICES = ("af_heart", "af_bella", "af_sky", "am_adam", "bf_emma", "zf_xiaobei", "zm_yunjian")
VOICE_STD = 0.15  # about the spread of the official packs' values

Size = Literal["tiny", "full"]
TINY_WIDTHS = {"hidden_dim": 64, "decoder_dim": 128, "asr_res_dim": 16, "upsample_initial_channel": 64}
"""Official: 512, 1024, 64, 512."""


def tiny_config() -> KokoroConfig:
    raw = KokoroConfig.official().to_dict()
    raw["plbert"].update(hidden_size=64, num_attention_heads=2, intermediate_size=128, num_hidden_layers=2)
    raw["n_layer"] = 1
    raw.update(hidden_dim=TINY_WIDTHS["hidden_dim"], decoder_dim=TINY_WIDTHS["decoder_dim"],
               asr_res_dim=TINY_WIDTHS["asr_res_dim"])
    raw["istftnet"].update(resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3, 5]],
                           upsample_initial_channel=TINY_WIDTHS["upsample_initial_channel"])
    return KokoroConfig.from_dict(raw, source="tiny config")


def random_model(config: KokoroConfig, seed: int) -> KokoroModel:
    """Our model with seeded random weights, initialised as the package initialises its modules."""
    torch.manual_seed(seed)
    model = KokoroModel(config)
    with torch.no_grad():
        for module in model.bert.modules():  # transformers' ALBERT init: N(0, 0.02), zero biases
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, 0.02)
            if isinstance(module, nn.Linear):
                module.bias.zero_()
        gen = model.decoder.generator  # iSTFTNet's init_weights: N(0, 0.01) for these convolutions
        for conv in [*gen.ups, gen.conv_post]:
            conv.weight.normal_(0.0, 0.01)
        for block in gen.resblocks:
            for conv in [*block.convs1, *block.convs2]:
                conv.weight.normal_(0.0, 0.01)
        duration = model.predictor.duration_proj.linear_layer
        duration.weight.normal_(0.0, DURATION_WEIGHT_STD)
        duration.bias.fill_(DURATION_BIAS)
        model.predictor.F0_proj.bias.fill_(F0_BIAS)
    return model.eval()


def write_random(directory: str | os.PathLike, size: Size = "tiny", seed: int = 0,
                 voices: tuple[str, ...] | None = None) -> Path:
    """Write a random checkpoint to ``directory`` (created) and return it; the CLI's entry point."""
    if size not in ("tiny", "full"):
        raise ValueError(f"size must be 'tiny' or 'full', got {size!r}")
    root = Path(directory)
    (root / VOICES_DIR).mkdir(parents=True, exist_ok=True)
    config = KokoroConfig.official() if size == "full" else tiny_config()
    if size == "full":
        shutil.copyfile(OFFICIAL_CONFIG, root / CONFIG_FILE)
    else:
        text = json.dumps(config.to_dict(), indent=2, ensure_ascii=False)
        (root / CONFIG_FILE).write_text(text + "\n", encoding="utf-8")
    torch.save(official_state_dicts(random_model(config, seed)), root / WEIGHTS_FILE)
    names = voices if voices is not None else (OFFICIAL_VOICES if size == "full" else TINY_VOICES)
    for i, name in enumerate(names):
        gen = torch.Generator().manual_seed(seed * 1000 + i)
        pack = torch.randn(PACK_ROWS, 1, config.voice_dim, generator=gen) * VOICE_STD
        torch.save(pack, root / VOICES_DIR / f"{name}.pt")
    return root
