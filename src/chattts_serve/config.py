"""Engine configuration: one dataclass, its fields map one-to-one onto CLI flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from .audio.stream import StreamPolicy
from .engine.scheduler import SchedulerConfig

DEFAULT_MODEL = "2Noise/ChatTTS"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    """Checkpoint directory or Hugging Face repo id."""
    device: str = "cpu"
    dtype: str = "float32"
    """GPT trunk dtype: float32, bfloat16, float16."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    stream: StreamPolicy = field(default_factory=StreamPolicy)
    """Default chunking policy of streamed requests."""
