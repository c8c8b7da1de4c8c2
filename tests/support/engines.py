"""Engine cores built by hand, for tests that need a config other than their engine's."""

from __future__ import annotations

from chattts_serve.engine.config import EngineConfig
from chattts_serve.engine.core import EngineCore
from chattts_serve.engine.plan import resolve_plan
from chattts_serve.models.chattts.stage import ChatTTSStage


def chattts_core(engine, config: EngineConfig) -> EngineCore:
    """An ``EngineCore`` on a loaded ChatTTS ``Engine``'s model and layout, run with ``config`` (its plan
    resolved for the engine's device)."""
    plan = resolve_plan(config, engine.device.type)
    return EngineCore(ChatTTSStage(engine.model, engine.tokenizer, config, engine.layout, plan), config)
