"""Activation ranges for ``int8-static``: run the fp32 model on sample texts and record, per linear
layer of the GPT, the largest |input| it saw (prefill of the prompt, the refine pass and audio decode).

Runs a one-slot ``EngineCore`` on the model as it is (fp32, projections fused, nothing swapped yet), so
every projection is a plain ``nn.Linear`` that the hooks see. ``models.chattts.prepare`` calls it.
"""

from __future__ import annotations

from ..kernels.quant import SPECS, record_absmax
from ..models.chattts.checkpoint import LoadedModel
from ..models.chattts.prepare import ModelLayout
from ..models.chattts.speaker import SpeakerStats, encode_speaker
from ..models.chattts.stage import ChatTTSStage
from ..models.chattts.tokenizer import Tokenizer
from ..sampling_params import RefineParams, SamplingParams
from .config import EngineConfig
from .core import EngineCore
from .plan import resolve_plan
from .scheduler import SchedulerConfig

CALIBRATION_TEXTS: tuple[str, ...] = (
    "四川美食确实以辣闻名，但也有不辣的选择，比如甜水面、赖汤圆、蛋烘糕、叶儿粑等。",
    "The quick brown fox jumps over the lazy dog, and then it takes a long nap in the warm sun.",
    "你好，今天我们来聊一聊 machine learning 和语音合成 [laugh] 的故事。",
)


def calibrate(
    model: LoadedModel,
    tokenizer: Tokenizer,
    speaker_stats: SpeakerStats | None,
    texts: tuple[str, ...] = CALIBRATION_TEXTS,
    audio_steps: int = 32,
    refine_steps: int = 8,
    seed: int = 0,
) -> dict[str, float]:
    """Largest |input| per ``nn.Linear`` of ``models.chattts.gpt`` (names as in ``named_modules``)."""
    import torch

    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=1, max_model_len=1024))
    plan = resolve_plan(config, model.embed.emb_text.weight.device.type)
    core = EngineCore(ChatTTSStage(model, tokenizer, config, ModelLayout(SPECS["fp32"]), plan), config)
    speaker = None
    if speaker_stats is not None:
        speaker = encode_speaker(speaker_stats.sample(torch.Generator().manual_seed(seed)))
    params = SamplingParams(
        seed=seed,
        speaker=speaker,
        max_new_tokens=audio_steps,
        refine=RefineParams(max_new_tokens=refine_steps),
    )

    def run() -> None:
        for i, text in enumerate(texts):
            core.add_request(f"calibrate-{i}", core.prepare(text, params))
        while core.has_unfinished():
            for out in core.step():
                if out.finish_reason == "error":
                    raise RuntimeError(f"calibration failed: {out.error}")

    return record_absmax(model.gpt, run)
