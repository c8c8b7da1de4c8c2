"""The fidelity cases: the same inputs go to the reference (scripts/reference_oracle.py) and to us."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from chattts_serve.models.chattts.checkpoint import SPK_STAT
from chattts_serve.models.chattts.speaker import (
    SpeakerStats,
    default_speaker_stats,
    encode_prompt_codes,
    encode_speaker,
)

GOLDEN_CHECKPOINT_SEED = 0


def speaker(ckpt: Path, seed: int) -> str:
    path = ckpt / SPK_STAT
    stats = SpeakerStats.from_string(path.read_text().strip()) if path.is_file() else default_speaker_stats()
    return encode_speaker(stats.sample(torch.Generator().manual_seed(seed)))


def build_cases(ckpt: Path) -> list[dict]:
    s1, s2 = speaker(ckpt, 1), speaker(ckpt, 2)
    sample = encode_prompt_codes(np.random.default_rng(0).integers(0, 625, size=(4, 40)))
    return [
        {"text": "今天天气真不错，我们一起去公园散步吧。", "speaker": s1, "seed": 11, "max_new_tokens": 300},
        {
            "text": "Hello world, this is a test of chat tts.",
            "speaker": s2,
            "seed": 12,
            "min_new_tokens": 128,
            "max_new_tokens": 128,
        },
        {"text": "今天天气[uv_break]真不错[laugh]，我们去公园吧", "seed": 13, "max_new_tokens": 200},
        {
            "text": "你好，很高兴认识你。",
            "speaker": s1,
            "seed": 21,
            "skip_refine": False,
            "refine_max_new_tokens": 48,
            "max_new_tokens": 150,
        },
        {
            "text": "Good morning, how are you today?",
            "speaker": s2,
            "seed": 22,
            "skip_refine": False,
            "refine_prompt": "[oral_2][laugh_0][break_6]",
            "prompt": "[speed_3]",
            "refine_max_new_tokens": 40,
            "max_new_tokens": 150,
        },
        {
            "text": "这是一个测试",
            "speaker": s2,
            "seed": 31,
            "temperature": [0.2, 0.3, 0.4, 0.5],
            "top_p": 0.8,
            "top_k": 10,
            "repetition_penalty": 1.2,
            "min_new_tokens": 110,
            "max_new_tokens": 150,
        },
        {
            "text": "我们来试试声音克隆",
            "speaker": s1,
            "seed": 41,
            "speaker_sample": sample,
            "speaker_sample_text": "你好",
            "min_new_tokens": 100,
            "max_new_tokens": 120,
        },
        {"text": "abc 123 ok!", "seed": 51, "normalize": False, "min_new_tokens": 100, "max_new_tokens": 100},
        # Longer than the official tokenizer's 256-token padding/truncation length: kept whole.
        {"text": LONG_TEXT, "speaker": s2, "seed": 61, "min_new_tokens": 40, "max_new_tokens": 40},
        # Split text: the reference's voice step (piece 0 spoken alone, its audio the voice sample of all).
        {
            "text": "今天天气真不错。我们一起去公园散步吧。你觉得怎么样。明天见。",
            "speaker": s1,
            "seed": 71,
            "split": True,
            "min_new_tokens": 30,
            "max_new_tokens": 30,
        },
        {
            "text": "Hello there. This is the second sentence. And the last one.",
            "speaker": s2,
            "seed": 72,
            "split": True,
            "max_new_tokens": 120,
        },
        # Brackets that are no control token (markdown links, a bracketed word): spoken as text, as LLM
        # output is; refine on, so the refine pass reads them too.
        {
            "text": "请看 **[Dapr](https://dapr.io/)** 的文档，[oral] 写得很好。",
            "speaker": s1,
            "seed": 81,
            "skip_refine": False,
            "refine_max_new_tokens": 24,
            "min_new_tokens": 30,
            "max_new_tokens": 30,
        },
        {"text": "See [the docs](https://example.com/a?b=1) [here].", "seed": 82, "max_new_tokens": 40},
    ]


# 330 characters, one token each: past the 256 ids of the tokenizer file's padding/truncation blocks.
LONG_TEXT = "".join("今天天气真不错我们一起去公园散步吧你觉得怎么样明天见"[i % 26] for i in range(300)) + (
    "，这是一段很长的文字，用来测试分词器不会截断。" * 1
)
