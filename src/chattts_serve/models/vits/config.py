"""VitsConfig: a Hugging Face VITS ``config.json`` (``model_type`` "vits") read once into a frozen dataclass.

Field names and defaults are transformers' ``VitsConfig`` (an MMS-TTS ``config.json`` lists them all), so a
file that transformers reads, we read the same way. Training-only fields (dropouts, ``layerdrop``,
``initializer_range``) are kept for a faithful round trip; the network does not read them. Everything the
network does read is validated here, so a config that could not run says so at load, naming the field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """config.json is missing, not VITS, or holds a value the network cannot run with."""


@dataclass(frozen=True)
class VitsConfig:
    vocab_size: int = 38
    hidden_size: int = 192
    num_hidden_layers: int = 6
    num_attention_heads: int = 2
    window_size: int | None = 4
    use_bias: bool = True
    ffn_dim: int = 768
    layerdrop: float = 0.1
    ffn_kernel_size: int = 3
    flow_size: int = 192
    spectrogram_bins: int = 513
    hidden_act: str = "relu"
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    activation_dropout: float = 0.1
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-5
    use_stochastic_duration_prediction: bool = True
    num_speakers: int = 1
    speaker_embedding_size: int = 0
    upsample_initial_channel: int = 512
    upsample_rates: tuple[int, ...] = (8, 8, 2, 2)
    upsample_kernel_sizes: tuple[int, ...] = (16, 16, 4, 4)
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    leaky_relu_slope: float = 0.1
    depth_separable_channels: int = 2
    depth_separable_num_layers: int = 3
    duration_predictor_flow_bins: int = 10
    duration_predictor_tail_bound: float = 5.0
    duration_predictor_kernel_size: int = 3
    duration_predictor_dropout: float = 0.5
    duration_predictor_num_flows: int = 4
    duration_predictor_filter_channels: int = 256
    prior_encoder_num_flows: int = 4
    prior_encoder_num_wavenet_layers: int = 4
    posterior_encoder_num_wavenet_layers: int = 16
    wavenet_kernel_size: int = 5
    wavenet_dilation_rate: int = 1
    wavenet_dropout: float = 0.0
    speaking_rate: float = 1.0
    noise_scale: float = 0.667
    noise_scale_duration: float = 0.8
    sampling_rate: int = 16000
    pad_token_id: int | None = None

    @property
    def sample_rate(self) -> int:
        return self.sampling_rate

    @property
    def samples_per_frame(self) -> int:
        """Audio samples per latent frame (a duration unit): the product of the decoder's upsampling rates."""
        return math.prod(self.upsample_rates)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "config.json") -> VitsConfig:
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{source}: expected a JSON object, found {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type != "vits":
            raise ConfigError(f"{source}: model_type is {model_type!r}, expected 'vits'")
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        for name in known:
            if name not in raw:
                continue  # transformers' default, as VitsConfig fills it
            value = raw[name]
            if name in ("upsample_rates", "upsample_kernel_sizes", "resblock_kernel_sizes"):
                value = _int_tuple(value, name, source)
            elif name == "resblock_dilation_sizes":
                if not isinstance(value, (list, tuple)):
                    raise ConfigError(f"{source}: {name} must be a list of lists of integers, got {value!r}")
                value = tuple(_int_tuple(v, name, source) for v in value)
            values[name] = value
        config = cls(**values)
        config.validate(source)
        return config

    @classmethod
    def from_file(cls, path: str | Path) -> VitsConfig:
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(raw, source=str(path))

    def validate(self, source: str = "config.json") -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ConfigError(f"{source}: {what}")

        def positive_int(name: str, value: Any, minimum: int = 1) -> None:
            need(isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
                 f"{name} must be an integer >= {minimum}, got {value!r}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "ffn_dim",
                     "ffn_kernel_size", "flow_size", "spectrogram_bins", "num_speakers", "upsample_initial_channel",
                     "depth_separable_num_layers", "duration_predictor_flow_bins", "duration_predictor_kernel_size",
                     "duration_predictor_filter_channels", "prior_encoder_num_flows",
                     "prior_encoder_num_wavenet_layers", "posterior_encoder_num_wavenet_layers",
                     "wavenet_kernel_size", "wavenet_dilation_rate", "sampling_rate"):
            positive_int(name, getattr(self, name))
        positive_int("duration_predictor_num_flows", self.duration_predictor_num_flows)
        positive_int("speaker_embedding_size", self.speaker_embedding_size, minimum=0)
        need(self.window_size is None or (isinstance(self.window_size, int) and self.window_size >= 1),
             f"window_size must be a positive integer or null, got {self.window_size!r}")
        need(self.hidden_size % self.num_attention_heads == 0,
             f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
             f"({self.num_attention_heads})")
        need(self.flow_size % 2 == 0, f"flow_size must be even (the coupling layers split it), got {self.flow_size}")
        need(self.depth_separable_channels == 2,
             f"depth_separable_channels must be 2 (the duration flows' two channels), got "
             f"{self.depth_separable_channels!r}")
        need(self.hidden_act == "relu", f"hidden_act {self.hidden_act!r} is not supported (MMS-TTS uses 'relu')")
        need(self.wavenet_kernel_size % 2 == 1, "wavenet_kernel_size must be odd")
        need(self.duration_predictor_kernel_size % 2 == 1, "duration_predictor_kernel_size must be odd")
        need(self.duration_predictor_flow_bins * 1e-3 <= 1.0, "duration_predictor_flow_bins is too large")
        need(isinstance(self.duration_predictor_tail_bound, (int, float)) and self.duration_predictor_tail_bound > 0,
             "duration_predictor_tail_bound must be positive")
        need(len(self.upsample_rates) == len(self.upsample_kernel_sizes) > 0,
             f"upsample_kernel_sizes ({len(self.upsample_kernel_sizes)}) and upsample_rates "
             f"({len(self.upsample_rates)}) must be non-empty and of one length")
        need(all(r >= 1 for r in self.upsample_rates), "upsample_rates must be positive")
        pairs = zip(self.upsample_kernel_sizes, self.upsample_rates, strict=True)
        need(all((k - r) % 2 == 0 and k >= r for k, r in pairs),
             "each upsample kernel size must be the rate plus an even number (the output is then rate x input)")
        need(self.upsample_initial_channel % 2 ** len(self.upsample_rates) == 0,
             "upsample_initial_channel must halve once per upsampling stage")
        need(len(self.resblock_kernel_sizes) == len(self.resblock_dilation_sizes) > 0,
             "resblock_kernel_sizes and resblock_dilation_sizes must be non-empty and of one length")
        need(all(k % 2 == 1 for k in self.resblock_kernel_sizes), "resblock_kernel_sizes must be odd")
        need(all(len(d) > 0 and all(x >= 1 for x in d) for d in self.resblock_dilation_sizes),
             "every resblock needs positive dilations")
        if self.num_speakers > 1:
            need(self.speaker_embedding_size > 0, "a multi-speaker config needs speaker_embedding_size > 0")
        for name in ("speaking_rate", "noise_scale", "noise_scale_duration", "leaky_relu_slope", "layer_norm_eps"):
            value = getattr(self, name)
            need(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                 f"{name} must be a number, got {value!r}")
        need(self.speaking_rate > 0, f"speaking_rate must be positive, got {self.speaking_rate!r}")

    def to_dict(self) -> dict[str, Any]:
        """The fields as config.json spells them (lists, not tuples); the writer adds the file's extras."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                value = [list(v) if isinstance(v, tuple) else v for v in value]
            out[f.name] = value
        return out


def _int_tuple(value: Any, name: str, source: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ConfigError(f"{source}: {name} must be a list of integers, got {value!r}")
    return tuple(value)
