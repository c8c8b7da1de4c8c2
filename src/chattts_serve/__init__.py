"""chattts-serve: a fast, faithful inference engine and server for ChatTTS."""

from .engine.config import EngineConfig
from .engine.outputs import Result
from .sampling_params import RefineParams, SamplingParams

__all__ = ["Engine", "EngineConfig", "Result", "SamplingParams", "RefineParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Engine pulls in torch: imported on first use, so `chattts-serve --help` and configs stay light.
    if name == "Engine":
        from .engine.engine import Engine

        return Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
