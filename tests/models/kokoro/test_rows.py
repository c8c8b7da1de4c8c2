"""A CPU batch's rows one per core (``models.kokoro.rows``): in order, each worker on one torch thread, a lone row on
the caller's threads, and every row's durations and F0 the same whichever thread count ran it, its waveform within
a rounding bound (torch and the graph)."""

from __future__ import annotations

import threading

import pytest
import torch

from chattts_serve import models
from chattts_serve.engine.config import EngineConfig
from chattts_serve.models.kokoro import kernels
from chattts_serve.models.kokoro.checkpoint import load
from chattts_serve.models.kokoro.rows import RowPool
from chattts_serve.models.kokoro.voices import load_voice, style_for
from chattts_serve.sampling_params import SamplingParams

from .test_model import _make, _utterances


def test_rows_run_in_order_one_torch_thread_each_and_a_lone_row_on_the_caller(two_threads):
    pool = RowPool(2)
    try:
        seen = pool.map(lambda i: (i, torch.get_num_threads(), threading.current_thread().name), range(6))
        assert [i for i, _, _ in seen] == list(range(6))
        assert {(n, name.startswith("kokoro-row")) for _, n, name in seen} == {(1, True)}
        [(_, n, name)] = pool.map(lambda i: (i, torch.get_num_threads(), threading.current_thread().name), [0])
        assert (n, name) == (2, threading.current_thread().name)
        assert torch.get_num_threads() == 2
        with pytest.raises(ZeroDivisionError):
            pool.map(lambda i: 1 / i, [1, 0, 2])
    finally:
        pool.close()


THREAD_BOUND = {"fp32": 1e-6, "ov-fp32": 1e-6, "ov-bf16": 2e-3}
"""A row's waveform on one thread against two (the convolutions blocked differently), tiny checkpoint, peaks ~0.1.
Measured: fp32 1.3e-7, ov-fp32 1.2e-7, ov-bf16 4e-4 (full size, peaks ~0.4: fp32 2.9e-7, ov-bf16 2.8e-3, under
its 39 dB from fp32). With the text side on the caller's threads instead, F0 moved by 1 ulp and the full-size audio
by 0.1."""


@pytest.mark.parametrize("mode", ["fp32", pytest.param("ov-fp32", marks=pytest.mark.slow), "ov-bf16"])
def test_a_rows_durations_and_f0_are_the_same_on_one_thread_or_two(kokoro_tiny, two_threads, mode):
    model = load(kokoro_tiny)
    model.text_threads = 1  # as the served model's, whenever it pools rows
    if mode != "fp32":
        pytest.importorskip("openvino")
        kernels.attach(model, mode, False, 2, style_for(load_voice(kokoro_tiny, "af_heart"), 40))
    utts = _utterances(kokoro_tiny, 4, seed0=700)
    alone = [model.synthesize([_make(u)])[0] for u in utts]  # on this thread, two torch threads
    pool = RowPool(2)
    try:
        pooled = pool.map(lambda u: model.synthesize([_make(u)])[0], utts)
    finally:
        pool.close()
    for a, b in zip(alone, pooled, strict=True):
        assert torch.equal(a.durations, b.durations) and torch.equal(a.f0, b.f0) and torch.equal(a.energy, b.energy)
        assert a.audio.shape == b.audio.shape and (a.audio - b.audio).abs().max().item() <= THREAD_BOUND[mode]


def test_the_served_model_runs_a_batchs_rows_side_by_side(kokoro_tiny, two_threads, monkeypatch):
    loaded = models.get("kokoro").load(kokoro_tiny, torch.device("cpu"), EngineConfig())
    text = "你好，世界。今天天气很好！我们去公园吧。"
    utterances = loaded.utterances(text, SamplingParams(speaker="zf_xiaobei", seed=4))
    alone = [s for u in utterances for s in loaded.synthesize([u])]
    threads = []
    real = loaded.model.synthesize
    monkeypatch.setattr(loaded.model, "synthesize",
                        lambda rows: threads.append(threading.current_thread().name) or real(rows))
    together = loaded.synthesize(utterances)
    assert len(threads) == len(utterances) == 3 and all(name.startswith("kokoro-row") for name in threads)
    assert loaded.model.text_threads == 1
    for a, b in zip(alone, together, strict=True):
        assert a.words == b.words and abs(a.audio - b.audio).max() <= THREAD_BOUND["fp32"]
