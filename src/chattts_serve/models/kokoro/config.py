"""KokoroConfig: the official ``config.json`` read once into a frozen, validated dataclass.

The network's shape is only partly in the official file: the decoder's widths (its 1024-channel blocks and
the 64-channel ASR residual) and the 24 kHz rate are written into the package's architecture
(``kokoro/istftnet.py`` hard-codes 1024, 64, and 512 for ``hidden_dim`` and ``upsample_initial_channel``).
We read the two widths from two optional top-level fields, ``decoder_dim`` and ``asr_res_dim``, whose
defaults are the official values, so the official file loads unchanged and a test checkpoint can be small
(``random_checkpoint.tiny_config``). They are top level, not in ``istftnet``: the package passes that
block to its ``Decoder`` as keyword arguments, where an unknown key is a TypeError, while it ignores
top-level keys it does not read. ``to_dict`` writes them only when they differ from the defaults, so the
official file round-trips byte for byte. Everything is checked at load, so a config that could not run
says so there, not deep in a forward.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

SAMPLE_RATE = 24000
# The official widths the package hard-codes; optional config fields here (``decoder_dim``, ``asr_res_dim``).
DECODER_DIM = 1024  # the decoder's encode/decode blocks
ASR_RES_DIM = 64  # the ASR residual re-injected into every decode block
_WIDTHS = {"decoder_dim": DECODER_DIM, "asr_res_dim": ASR_RES_DIM}
"""The optional width fields and their official values (written by ``to_dict`` only when they differ)."""
HARMONICS = 8  # the sine source's overtones above F0 (9 sines in all)
VOICED_THRESHOLD = 10.0  # Hz: F0 above this is voiced
SINE_AMP = 0.1
NOISE_STD = 0.003

OFFICIAL_CONFIG = Path(__file__).with_name("data") / "config.json"


class ConfigError(ValueError):
    """config.json is missing a field or holds a value the network cannot run with."""


@dataclass(frozen=True)
class PlbertConfig:
    """The phoneme-level ALBERT (``plbert``); unset ALBERT fields take transformers' AlbertConfig defaults."""

    hidden_size: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    num_hidden_layers: int
    dropout: float = 0.1
    embedding_size: int = 128
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class IstftnetConfig:
    upsample_kernel_sizes: tuple[int, ...]
    upsample_rates: tuple[int, ...]
    gen_istft_hop_size: int
    gen_istft_n_fft: int
    resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    resblock_kernel_sizes: tuple[int, ...]
    upsample_initial_channel: int

    @property
    def upsample_scale(self) -> int:
        """Audio samples per F0 value (F0 runs at twice the frame rate)."""
        return math.prod(self.upsample_rates) * self.gen_istft_hop_size


@dataclass(frozen=True)
class KokoroConfig:
    n_token: int
    hidden_dim: int
    style_dim: int
    n_layer: int
    n_mels: int
    max_dur: int
    dropout: float
    text_encoder_kernel_size: int
    plbert: PlbertConfig
    istftnet: IstftnetConfig
    vocab: Mapping[str, int] = field(repr=False)
    # Carried from the file for a faithful round trip; the network does not read them.
    dim_in: int = 64
    max_conv_dim: int = 512
    multispeaker: bool = True
    # Not in the official file (the package hard-codes them): the decoder's widths.
    decoder_dim: int = DECODER_DIM
    asr_res_dim: int = ASR_RES_DIM

    @property
    def sample_rate(self) -> int:
        return SAMPLE_RATE

    @property
    def samples_per_frame(self) -> int:
        """Audio samples per duration frame: the decoder doubles the frame rate, then upsamples."""
        return 2 * self.istftnet.upsample_scale

    @property
    def context_length(self) -> int:
        """Most input ids (boundaries included) one utterance may hold: ALBERT's position table."""
        return self.plbert.max_position_embeddings

    @property
    def voice_dim(self) -> int:
        """A voice row: the decoder's style, then the prosody predictor's."""
        return 2 * self.style_dim

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "config.json") -> KokoroConfig:
        try:
            plbert_raw = dict(raw["plbert"])
            istft_raw = dict(raw["istftnet"])
            plbert = PlbertConfig(
                **{k: plbert_raw[k] for k in ("hidden_size", "num_attention_heads", "intermediate_size",
                                              "max_position_embeddings", "num_hidden_layers")},
                **{k: plbert_raw[k] for k in ("dropout", "embedding_size", "type_vocab_size", "layer_norm_eps")
                   if k in plbert_raw},
            )
            istft = IstftnetConfig(
                upsample_kernel_sizes=tuple(istft_raw["upsample_kernel_sizes"]),
                upsample_rates=tuple(istft_raw["upsample_rates"]),
                gen_istft_hop_size=istft_raw["gen_istft_hop_size"],
                gen_istft_n_fft=istft_raw["gen_istft_n_fft"],
                resblock_dilation_sizes=tuple(tuple(d) for d in istft_raw["resblock_dilation_sizes"]),
                resblock_kernel_sizes=tuple(istft_raw["resblock_kernel_sizes"]),
                upsample_initial_channel=istft_raw["upsample_initial_channel"],
            )
            config = cls(
                n_token=raw["n_token"], hidden_dim=raw["hidden_dim"], style_dim=raw["style_dim"],
                n_layer=raw["n_layer"], n_mels=raw["n_mels"], max_dur=raw["max_dur"], dropout=raw["dropout"],
                text_encoder_kernel_size=raw["text_encoder_kernel_size"], plbert=plbert, istftnet=istft,
                vocab=MappingProxyType(dict(raw["vocab"])),
                **{k: raw[k] for k in ("dim_in", "max_conv_dim", "multispeaker", *_WIDTHS) if k in raw},
            )
        except KeyError as exc:
            raise ConfigError(f"{source}: missing field {exc.args[0]!r}") from None
        except TypeError as exc:
            raise ConfigError(f"{source}: malformed field ({exc})") from None
        config.validate(source)
        return config

    @classmethod
    def from_file(cls, path: str | Path) -> KokoroConfig:
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def official(cls) -> KokoroConfig:
        """The public hexgrad/Kokoro-82M config.json shipped with the package."""
        return cls.from_file(OFFICIAL_CONFIG)

    def validate(self, source: str = "config.json") -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ConfigError(f"{source}: {what}")

        ints = {"n_token": self.n_token, "hidden_dim": self.hidden_dim, "style_dim": self.style_dim,
                "n_layer": self.n_layer, "max_dur": self.max_dur,
                "text_encoder_kernel_size": self.text_encoder_kernel_size, "decoder_dim": self.decoder_dim,
                "asr_res_dim": self.asr_res_dim, "upsample_initial_channel": self.istftnet.upsample_initial_channel}
        for name, value in ints.items():
            need(isinstance(value, int) and not isinstance(value, bool) and value > 0,
                 f"{name} must be a positive integer, got {value!r}")
        need(self.text_encoder_kernel_size % 2 == 1, "text_encoder_kernel_size must be odd")
        need(0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), got {self.dropout!r}")
        p = self.plbert
        need(p.hidden_size > 0 and p.num_attention_heads > 0 and p.hidden_size % p.num_attention_heads == 0,
             "plbert.hidden_size must be a positive multiple of plbert.num_attention_heads")
        need(p.num_hidden_layers > 0 and p.intermediate_size > 0, "plbert layer sizes must be positive")
        need(p.max_position_embeddings >= 3, "plbert.max_position_embeddings must be at least 3")
        i = self.istftnet
        need(len(i.upsample_rates) == len(i.upsample_kernel_sizes) > 0,
             "istftnet.upsample_rates and upsample_kernel_sizes must be non-empty and of one length")
        need(len(i.resblock_kernel_sizes) == len(i.resblock_dilation_sizes) > 0,
             "istftnet.resblock_kernel_sizes and resblock_dilation_sizes must be non-empty and of one length")
        need(all(len(d) > 0 for d in i.resblock_dilation_sizes), "every resblock needs dilations")
        need(i.gen_istft_n_fft > 0 and i.gen_istft_n_fft % 2 == 0, "istftnet.gen_istft_n_fft must be even")
        need(i.gen_istft_hop_size > 0, "istftnet.gen_istft_hop_size must be positive")
        need(i.upsample_initial_channel % 2 ** len(i.upsample_rates) == 0,
             "istftnet.upsample_initial_channel must halve at every upsampling stage")
        ids = list(self.vocab.values())
        need(len(ids) > 0, "vocab is empty")
        need(all(isinstance(t, str) and len(t) == 1 for t in self.vocab), "vocab keys must be single characters")
        need(all(isinstance(v, int) and 0 < v < self.n_token for v in ids),
             f"vocab ids must be integers in [1, n_token={self.n_token}) (0 is the boundary token)")

    def to_dict(self) -> dict[str, Any]:
        """The config.json layout (field order as the official file)."""
        i, p = self.istftnet, self.plbert
        return {
            "istftnet": {
                "upsample_kernel_sizes": list(i.upsample_kernel_sizes), "upsample_rates": list(i.upsample_rates),
                "gen_istft_hop_size": i.gen_istft_hop_size, "gen_istft_n_fft": i.gen_istft_n_fft,
                "resblock_dilation_sizes": [list(d) for d in i.resblock_dilation_sizes],
                "resblock_kernel_sizes": list(i.resblock_kernel_sizes),
                "upsample_initial_channel": i.upsample_initial_channel,
            },
            "dim_in": self.dim_in, "dropout": self.dropout, "hidden_dim": self.hidden_dim,
            "max_conv_dim": self.max_conv_dim, "max_dur": self.max_dur, "multispeaker": self.multispeaker,
            "n_layer": self.n_layer, "n_mels": self.n_mels, "n_token": self.n_token, "style_dim": self.style_dim,
            "text_encoder_kernel_size": self.text_encoder_kernel_size,
            "plbert": {
                "hidden_size": p.hidden_size, "num_attention_heads": p.num_attention_heads,
                "intermediate_size": p.intermediate_size, "max_position_embeddings": p.max_position_embeddings,
                "num_hidden_layers": p.num_hidden_layers, "dropout": p.dropout,
            },
            "vocab": dict(self.vocab),
            **{k: getattr(self, k) for k, default in _WIDTHS.items() if getattr(self, k) != default},
        }
