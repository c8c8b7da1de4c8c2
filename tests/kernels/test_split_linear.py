"""kernels/split_linear.py: the reference-exact fp32 path's one-row matmuls split across threads, F.linear's bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from chattts_serve.kernels import cpp_build, split_linear

needs_op = pytest.mark.skipif(cpp_build.find_compiler() is None, reason="the op is built with a C++ compiler")


@needs_op
@pytest.mark.parametrize("out_in", [(768, 768), (3072, 768), (768, 3072), (128, 64), (200, 48)])
@pytest.mark.parametrize("parts", [2, 3, 4])
def test_split_rows_give_f_linears_bits(out_in, parts, two_threads):
    """The full model's shapes (q/k/v/o, gate/up, down), the tiny one's and a width that is no multiple of the
    slice alignment: every slicing gives F.linear's result bit for bit (the property ``split_linears_`` checks)."""
    assert split_linear.available()
    gen = torch.Generator().manual_seed(parts)
    w = torch.randn(*out_in, generator=gen) / 30
    x = torch.randn(1, out_in[1], generator=gen)
    assert torch.equal(split_linear.split_linear(x, w, parts), F.linear(x, w))


@needs_op
def test_only_one_row_calls_on_more_than_one_thread_split(two_threads, monkeypatch):
    lin = nn.Linear(64, 256, bias=False)
    [(_, split)] = _swapped(lin)
    calls = []
    real = split_linear.split_linear
    monkeypatch.setattr(split_linear, "split_linear", lambda *a: calls.append(a[2]) or real(*a))
    with torch.inference_mode():
        for shape in ((1, 64), (1, 1, 64), (3, 64)):
            x = torch.randn(*shape)
            assert torch.equal(split(x), F.linear(x, lin.weight))
        torch.set_num_threads(1)
        split(torch.randn(1, 64))
    assert calls == [2, 2]  # the two one-row calls at 2 threads; not 3 rows, not 1 thread


def _swapped(lin: nn.Linear) -> list[tuple[str, nn.Module]]:
    holder = nn.Sequential(lin)
    n = split_linear.split_linears_(holder)
    swapped = [(name, m) for name, m in holder.named_children() if isinstance(m, split_linear.SplitLinear)]
    assert len(swapped) == n
    return swapped


@needs_op
def test_a_shape_that_splits_with_other_bits_keeps_f_linear(monkeypatch):
    monkeypatch.setattr(split_linear, "_splits_exactly", lambda w: False)
    holder = nn.Sequential(nn.Linear(64, 256, bias=False))
    assert split_linear.split_linears_(holder) == 0 and type(holder[0]) is nn.Linear
    narrow_or_biased = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 256))
    monkeypatch.undo()
    assert split_linear.split_linears_(narrow_or_biased) == 0  # too narrow to split; a bias


@needs_op
def test_the_fp32_one_slot_engine_splits_with_the_same_bits(tiny_ckpt, monkeypatch):
    """The reference-exact layout (fp32, one slot; its 1-thread run is the fidelity goldens' path): at 2 threads
    its one-row matmuls split (the tiny model's gate and up projections) and the codes, hidden states and audio
    are those of the same engine with F.linear, and the codes those of one thread."""
    from chattts_serve.engine.config import EngineConfig
    from chattts_serve.engine.engine import Engine
    from chattts_serve.models.chattts import prepare
    from chattts_serve.sampling_params import SamplingParams

    params = SamplingParams(seed=4, max_new_tokens=24, refine_text=False)

    def run(threads: int, split: bool):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with monkeypatch.context() as m:
                if not split:
                    m.setattr(prepare, "split_linears_", lambda module: 0)
                engine = Engine.from_pretrained(tiny_ckpt, config=EngineConfig.with_slots(1))
                swapped = sum(isinstance(x, split_linear.SplitLinear) for x in engine.model.gpt.modules())
                assert swapped == (4 if split else 0)
                [result] = engine.synthesize(["Hello there, one slot."], params)
                engine.close()
                return result
        finally:
            torch.set_num_threads(before)

    split, plain, one = run(2, True), run(2, False), run(1, True)
    for field in ("codes", "audio"):
        np.testing.assert_array_equal(getattr(split, field), getattr(plain, field))
    np.testing.assert_array_equal(split.codes, one.codes)  # (the audio stage's convolutions round by thread count)
