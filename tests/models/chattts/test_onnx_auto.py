"""ort-auto (models/chattts/onnx_auto.py): the int4 and int8 ORT sessions of the tiny checkpoint over one KV
cache, each call sent to one of them by its width; checked against the same calls made directly on
the session the dispatch should have chosen, over a cache of their own."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime", reason="the ort-* precisions need the [onnx] extra")

from chattts_serve.cpu import parse_cpuinfo  # noqa: E402
from chattts_serve.models.chattts import checkpoint  # noqa: E402
from chattts_serve.models.chattts.onnx_auto import CROSSOVER_TABLE, AutoTrunk, resolve_crossover  # noqa: E402
from chattts_serve.models.chattts.onnx_export import cached_export  # noqa: E402
from chattts_serve.models.chattts.onnx_trunk import OnnxTrunk  # noqa: E402

SLOTS, MAX_LEN, CROSSOVER = 4, 48, 3
# Bound of a 4-bit step's hidden state vs torch fp32 on the tiny random checkpoint (tests/models/chattts/test_onnx.py).
INT4_BOUND = 0.3


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return checkpoint.load(tiny_ckpt)


@pytest.fixture(scope="module")
def trunks(model, onnx_cache_dir):
    """(int4, int8) sessions, from the exports the engine tests load too (same cache directory)."""
    cpu = torch.device("cpu")

    def session(weights: str) -> OnnxTrunk:
        return OnnxTrunk(cached_export(model, weights, onnx_cache_dir), model.config.gpt, weights, cpu)

    return session("int4"), session("int8")


# (what, slots 0..rows-1 in the call, positions per row): one wide prefill, then decode steps of
# one, two and three rows (the crossover), then one row again; widths 15, 1, 2, 3, 1.
CALLS = [("prefill", 3, 5), ("decode", 1, 1), ("decode", 2, 1), ("decode", 3, 1), ("decode", 1, 1)]


def _script(model, fn):
    """Run CALLS through ``fn(embeds, seqlens_k, query_seqlens) -> hidden`` (which holds its own
    cache; slots 0..rows-1 of it); returns each call's hidden state."""
    gen = torch.Generator().manual_seed(0)
    hidden = model.config.gpt.hidden_size
    lengths = [0] * SLOTS
    outs = []
    for _kind, rows, n in CALLS:
        x = torch.randn(rows, n, hidden, generator=gen)
        seqlens = np.array([lengths[r] + n - 1 for r in range(rows)], np.int32)
        outs.append(fn(x, seqlens, np.full(rows, n, np.int32)))
        for r in range(rows):
            lengths[r] += n
    return outs


def test_dispatch_by_width_on_one_shared_cache(model, trunks):
    """Each call's result is what the session the dispatch chose computes from the same cache state:
    int4 below the crossover, int8 at and above it; the cache the int8 prefill wrote is read and
    extended by int4 steps and back."""
    small, large = trunks
    auto = AutoTrunk(small, large, CROSSOVER)
    cache = auto.new_cache(SLOTS, MAX_LEN)
    cache.k.zero_(), cache.v.zero_()  # positions no call writes compare equal below
    got = _script(model, lambda x, s, q: auto.run(x, cache, 0, s, q).clone())

    # The same calls, each sent by hand to the session its width selects, over a cache of their own.
    want_cache = small.new_cache(SLOTS, MAX_LEN)
    want_cache.k.zero_(), want_cache.v.zero_()
    chosen = []

    def by_hand(x, s, q):
        width = x.shape[0] * x.shape[1]
        trunk = small if width < CROSSOVER else large
        chosen.append(trunk.manifest.weights)
        return trunk.run(x, want_cache, 0, s, q).clone()

    want = _script(model, by_hand)
    assert chosen == ["int8", "int4", "int4", "int8", "int4"]
    assert auto.calls == {"small": 3, "large": 2} and auto.rows == {"small": 4, "large": 18}
    for (kind, rows, n), g, w in zip(CALLS, got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=f"{kind} of {rows} rows x {n}")
    torch.testing.assert_close(cache.k, want_cache.k, rtol=0, atol=0)
    torch.testing.assert_close(cache.v, want_cache.v, rtol=0, atol=0)
    # The two sessions did different work: the 4-bit and int8 steps are not one kernel.
    large_cache = large.new_cache(SLOTS, MAX_LEN)
    only_large = _script(model, lambda x, s, q: large.run(x, large_cache, 0, s, q).clone())
    assert torch.equal(got[0], only_large[0]) and not torch.equal(got[1], only_large[1])


def test_steps_after_a_switch_continue_the_sequence(model, trunks):
    """An int8 prefill continued by 4-bit decode steps (and the reverse) stays within the 4-bit mode's
    bound of torch fp32 at every step: each session reads what the other cached."""
    small, large = trunks
    gpt, hidden = model.gpt, model.config.gpt.hidden_size
    gen = torch.Generator().manual_seed(1)
    prompt, steps = 9, 6
    emb = torch.randn(1, prompt + steps, hidden, generator=gen)
    with torch.inference_mode():
        ref_cache = gpt.new_cache(1, MAX_LEN)
        ref = gpt(emb, torch.arange(prompt + steps)[None], ref_cache, torch.tensor([0]), 0, None, last_only=False)[0]
    for crossover, prefill_in, decode_in in ((2, "large", "small"), (100, "small", "small")):
        auto = AutoTrunk(small, large, crossover)
        cache = auto.new_cache(1, MAX_LEN)
        one = np.ones(1, np.int32)
        auto.run(emb[:, :prompt], cache, 0, one * (prompt - 1), one * prompt)
        assert auto.calls[prefill_in] == 1
        for pos in range(prompt, prompt + steps):
            h = auto.run(emb[:, pos : pos + 1], cache, 0, one * pos, one)[0, 0]
            assert float((h - ref[pos]).norm() / ref[pos].norm()) < INT4_BOUND, (crossover, pos)
        assert auto.calls[decode_in] >= steps
        assert torch.isfinite(cache.k[:, 0, :, : prompt + steps]).all()


def test_for_rows_and_the_refusals(trunks):
    small, large = trunks
    auto = AutoTrunk(small, large, 4)
    assert auto.for_rows(1) is small and auto.for_rows(3) is small
    assert auto.for_rows(4) is large and auto.for_rows(64) is large
    assert small.for_rows(64) is small  # a plain session is its own choice at any width
    assert auto.weight_bytes == small.weight_bytes + large.weight_bytes
    with pytest.raises(ValueError, match="crossover must be >= 1"):
        AutoTrunk(small, large, 0)
    with pytest.raises(ValueError, match="exceeds the export's rotary table"):
        auto.new_cache(1, auto.max_positions + 1)


CPUINFO = "processor\t: 0\nflags\t\t: fpu sse2 {}\n"


@pytest.mark.parametrize(
    ("flags", "kind"),
    [
        ("avx2 avx512f avx512_vnni amx_tile amx_int8 amx_bf16", "amx"),
        ("avx2 avx512f avx512_vnni avx512_bf16", "avx512_vnni"),
        ("avx2 fma", "avx2"),
        ("", "other"),
    ],
)
def test_cpu_kind_and_the_table(flags, kind):
    info = parse_cpuinfo(CPUINFO.format(flags), arch="x86_64")
    assert info.kind == kind
    assert resolve_crossover(0, info) == (CROSSOVER_TABLE[kind], f"table ({kind})")
    assert resolve_crossover(5, info) == (5, "configured")  # a configured crossover wins over the table


def test_negative_crossover_is_refused():
    with pytest.raises(ValueError, match="ort_auto_crossover must be >= 0"):
        resolve_crossover(-1)
