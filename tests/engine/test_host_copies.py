"""No host-to-device copy blocks the engine thread (issue 31, item 5): a request's speaker embedding and
the prefill's position tables cross through pinned memory without waiting (stand-in CUDA calls tell a
pinned non-blocking copy from a pageable one, ``tests/support/cuda_stub.py``), and statically, no
``.to(..., non_blocking=True)`` in the package starts from memory that may be pageable."""

from __future__ import annotations

import ast
from dataclasses import replace

import numpy as np
import torch

import chattts_serve
from chattts_serve import SamplingParams
from chattts_serve.audio.policy import StreamPolicy
from chattts_serve.engine.pipeline import RequestPipeline
from tests.support.cuda_stub import FakeCuda

CUDA1 = torch.device("cuda", 1)


def test_a_requests_speaker_crosses_from_pinned_memory(tiny_engine, monkeypatch):
    gpt = tiny_engine.model.config.gpt
    prepared = tiny_engine.core.prepare("你好。", SamplingParams(seed=1, refine_text=False))
    prepared = replace(prepared, speaker=np.ones(gpt.hidden_size, np.float16))
    calls = FakeCuda.install(monkeypatch)
    pipeline = RequestPipeline(tiny_engine.tokenizer, gpt.hidden_size, gpt.num_vq, 256, CUDA1, num_slots=2)
    [seq] = pipeline.start("r", prepared, StreamPolicy(), 0, 0.0)
    assert seq.payload.speaker is not None
    assert calls.named("h2d") == [CUDA1] and not calls.named("h2d blocking"), calls.log


def _pageable_non_blocking(tree: ast.AST, where: str) -> list[str]:
    """``x.to(..., non_blocking=True)`` calls: on a pageable source the host waits anyway (``pinned_copy``
    is the one place that makes the source pinned first)."""
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to":
            if any(k.arg == "non_blocking" for k in node.keywords):
                src = node.func.value
                pinned = isinstance(src, ast.Call) and getattr(src.func, "attr", "") == "pin_memory"
                if not pinned:
                    bad.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return bad


def test_no_non_blocking_copy_starts_from_pageable_memory():
    root = __import__("pathlib").Path(chattts_serve.__file__).parent
    bad = []
    for path in sorted(root.rglob("*.py")):
        bad += _pageable_non_blocking(ast.parse(path.read_text()), str(path.relative_to(root.parent)))
    assert not bad, "non_blocking copies from possibly pageable memory:\n" + "\n".join(bad)


def test_the_static_check_sees_one():
    assert _pageable_non_blocking(ast.parse("pos.to(dev, non_blocking=True)"), "x.py")
    assert not _pageable_non_blocking(ast.parse("t.pin_memory().to(dev, non_blocking=True)"), "x.py")
