"""chattts-serve: a fast, faithful inference engine and server for ChatTTS."""

from .engine.engine import Engine, Result
from .sampling_params import RefineParams, SamplingParams

__all__ = ["Engine", "Result", "SamplingParams", "RefineParams"]
__version__ = "0.1.0"
