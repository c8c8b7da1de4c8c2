"""Model dimensions. They are read from the checkpoint itself (``asset/gpt/config.json`` plus tensor
shapes), never hard-coded at the call sites, so tiny test checkpoints load through the same code.

``ModelConfig.full()`` and ``ModelConfig.tiny()`` are the two presets that ``random_checkpoint.write_random``
writes; ``full`` is the official ChatTTS size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MODEL = "2Noise/ChatTTS"
"""The official checkpoint (Hugging Face hub repo id), used when no ``--model`` is given."""

# Fixed by the audio format and the tokenizer; the same for every ChatTTS checkpoint.
SAMPLE_RATE = 24_000
N_FFT = 1024
HOP_LENGTH = 256
NUM_MELS = 100
SAMPLES_PER_TOKEN = 2 * HOP_LENGTH  # one GPT step = 4 codes = 2 mel frames = 512 samples
TOKENS_PER_SECOND = SAMPLE_RATE / SAMPLES_PER_TOKEN  # 46.875
NUM_VQ = 4
NUM_AUDIO_TOKENS = 626  # 625 FSQ codes (5**4) + EOS
AUDIO_EOS = NUM_AUDIO_TOKENS - 1
NUM_TEXT_TOKENS = 21178  # bert-base-chinese WordPiece (21128) + 50 ChatTTS control tokens


@dataclass(frozen=True, slots=True)
class GPTConfig:
    """LLaMA-style trunk (no biases, RMSNorm, rotate-half RoPE, SwiGLU MLP)."""

    hidden_size: int = 768
    num_layers: int = 20
    num_heads: int = 12
    num_kv_heads: int = 12
    intermediate_size: int = 3072
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    num_audio_tokens: int = NUM_AUDIO_TOKENS
    num_text_tokens: int = NUM_TEXT_TOKENS
    num_vq: int = NUM_VQ

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} not divisible by num_kv_heads {self.num_kv_heads}")
        if self.hidden_size % 2:
            raise ValueError(f"hidden_size {self.hidden_size} must be even (the Decoder splits it in two)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True, slots=True)
class ConvStackConfig:
    """The ConvNeXt stack shared by the Decoder, the DVAE decoder and the DVAE encoder."""

    idim: int
    odim: int
    hidden: int
    num_layers: int
    bn_dim: int
    kernel: int = 7
    dilation: int = 2


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    """Hidden states -> mel (``asset/Decoder.safetensors``). ``stack.idim`` is hidden_size / 2."""

    stack: ConvStackConfig = field(
        default_factory=lambda: ConvStackConfig(idim=384, odim=384, hidden=512, num_layers=12, bn_dim=128)
    )


@dataclass(frozen=True, slots=True)
class DVAEConfig:
    """Codes <-> mel (``asset/DVAE.safetensors``): GFSQ (G groups x R residual levels) + conv stacks."""

    decoder: ConvStackConfig = field(
        default_factory=lambda: ConvStackConfig(idim=512, odim=512, hidden=256, num_layers=12, bn_dim=128)
    )
    encoder: ConvStackConfig = field(
        default_factory=lambda: ConvStackConfig(idim=512, odim=1024, hidden=256, num_layers=12, bn_dim=128)
    )
    vq_dim: int = 1024
    levels: tuple[int, ...] = (5, 5, 5, 5)
    groups: int = 2
    residuals: int = 2

    @property
    def dim(self) -> int:
        """Channels after the 2x frame expansion (= decoder idim = downsample width)."""
        return self.vq_dim // 2


@dataclass(frozen=True, slots=True)
class VocosConfig:
    """Vocos vocoder: ConvNeXt backbone + ISTFT head."""

    dim: int = 512
    intermediate_dim: int = 1536
    num_layers: int = 8


@dataclass(frozen=True, slots=True)
class ModelConfig:
    gpt: GPTConfig = field(default_factory=GPTConfig)
    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    dvae: DVAEConfig = field(default_factory=DVAEConfig)
    vocos: VocosConfig = field(default_factory=VocosConfig)

    @classmethod
    def full(cls) -> ModelConfig:
        return cls()

    @classmethod
    def tiny(cls) -> ModelConfig:
        """A few-MB model with the same structure, for unit tests (text vocab stays official)."""
        return cls(
            gpt=GPTConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=128),
            decoder=DecoderConfig(ConvStackConfig(idim=32, odim=32, hidden=48, num_layers=2, bn_dim=16)),
            dvae=DVAEConfig(
                decoder=ConvStackConfig(idim=32, odim=32, hidden=24, num_layers=2, bn_dim=16),
                encoder=ConvStackConfig(idim=32, odim=64, hidden=24, num_layers=2, bn_dim=16),
                vq_dim=64,
            ),
            vocos=VocosConfig(dim=32, intermediate_dim=64, num_layers=2),
        )
