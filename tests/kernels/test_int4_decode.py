"""The int4 trunk's decode step as one C++ call: GPT.decode's result and cache writes to the bit."""

from __future__ import annotations

import pytest
import torch

from chattts_serve.kernels import decode_attention, int4_gemv
from chattts_serve.kernels.quant import parse_precision
from chattts_serve.models.chattts import checkpoint
from chattts_serve.models.chattts.prepare import prepare_model

needs_ops = pytest.mark.skipif(
    not (int4_gemv.cpu_supported() and decode_attention.cpu_supported()),
    reason="the C++ GEMV and attention need AVX-512 VNNI",
)
POSITIONS = 40


@pytest.fixture(scope="module")
def gpt(tiny_ckpt):
    model = checkpoint.load(tiny_ckpt)
    prepare_model(model, parse_precision("int4"), num_slots=4)
    return model.gpt


def filled_cache(gpt, dtype):
    """A cache whose first POSITIONS positions of every slot hold random keys and values."""
    cfg = gpt.cfg
    cache = gpt.new_cache(4, 64, dtype=dtype)
    cache.zero_()
    gen = torch.Generator().manual_seed(0)
    for layer in range(cfg.num_layers):
        k = torch.randn(4, cfg.num_kv_heads, POSITIONS, cfg.head_dim, generator=gen)
        cache.write(layer, (slice(None), slice(None), slice(0, POSITIONS)), k, torch.randn(k.shape, generator=gen))
    return cache


def clone_cache(gpt, cache):
    other = gpt.new_cache(cache.num_slots, cache.max_len, dtype=cache.k.dtype)
    for name, buf in cache.named_buffers():
        getattr(other, name).copy_(buf)
    return other


def eager_decode(gpt, *args, **kwargs):
    fused, gpt.fused_decode = gpt.fused_decode, None
    try:
        return gpt.decode(*args, **kwargs)
    finally:
        gpt.fused_decode = fused


@needs_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_the_step_is_gpt_decodes_to_the_bit(gpt, dtype):
    assert gpt.fused_decode is not None
    fused_cache = filled_cache(gpt, dtype)
    eager_cache = clone_cache(gpt, fused_cache)
    emb = torch.randn(3, gpt.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    slots, lengths = [2, 0, 3], [10, POSITIONS - 1, 25]
    # Three rows padded to four: the padding row attends to nothing and writes nothing.
    fused = gpt.decode(emb, fused_cache, slots, lengths, pad_rows_to=4)
    eager = eager_decode(gpt, emb, eager_cache, slots, lengths, pad_rows_to=4)
    assert fused.shape == (4, gpt.cfg.hidden_size)
    torch.testing.assert_close(fused, eager, rtol=0, atol=0)
    for name, buf in fused_cache.named_buffers():
        torch.testing.assert_close(buf, getattr(eager_cache, name), rtol=0, atol=0, msg=name)


@needs_ops
@pytest.mark.parametrize("hidden", [64, 768])
@pytest.mark.parametrize("rows", [1, 5, 130])
def test_the_steps_norm_is_torchs_to_the_bit(gpt, hidden, rows):
    """The step's RMSNorm (ATen's row sums, the rest in C++) gives ``F.rms_norm``'s bits, over magnitudes
    from 1e-3 to 1e3 (the torch ops ``GPT.decode`` runs)."""
    gen = torch.Generator().manual_seed(hidden + rows)
    w = torch.randn(hidden, generator=gen)
    for _ in range(20):
        scale = 10.0 ** torch.randint(-3, 4, (rows, 1), generator=gen)
        x = torch.randn(rows, hidden, generator=gen) * scale
        got = torch.ops.chattts_int4_gemv.rms_norm(x, w, 1e-5)
        torch.testing.assert_close(got, torch.nn.functional.rms_norm(x, (hidden,), w, 1e-5), rtol=0, atol=0)


@needs_ops
def test_the_steps_weights_are_one_stream_held_once(gpt):
    """Every layer's packed weights lie in one buffer in the order the step reads them (qkv, o, gate/up,
    down, layer after layer), and the linears use those same bytes: no second copy."""
    linears = [
        m
        for layer in gpt.layers
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    ]
    blobs = gpt.fused_decode.blobs
    assert len(blobs) == len(linears)
    base = blobs[0].untyped_storage().data_ptr()
    at = blobs[0].data_ptr()
    for lin, blob in zip(linears, blobs, strict=True):
        assert blob.untyped_storage().data_ptr() == base and blob.data_ptr() == at
        assert lin.packed.blob.data_ptr() == blob.data_ptr()
        at += blob.numel()


@needs_ops
def test_a_row_alone_is_the_row_in_a_batch(gpt):
    emb = torch.randn(5, gpt.cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    batch = gpt.decode(emb[:3], filled_cache(gpt, torch.bfloat16), [1, 2, 3], [12, 30, 5])
    alone = gpt.decode(emb[1:2], filled_cache(gpt, torch.bfloat16), [2], [30])
    torch.testing.assert_close(batch[1:2], alone, rtol=0, atol=0)


@needs_ops
def test_a_slot_out_of_range_is_an_error_not_a_write(gpt):
    cache = filled_cache(gpt, torch.bfloat16)
    cfg = gpt.cfg
    f = gpt.fused_decode
    h = torch.zeros(1, cfg.hidden_size)
    cos = sin = torch.zeros(1, cfg.head_dim)
    for slots, pos in (([4], [0]), ([0], [64]), ([-1], [0])):
        with pytest.raises(RuntimeError, match="out of range"):
            f.run(h, cos, sin, cache.k, cache.v, None, torch.tensor(slots), torch.tensor(pos))


def test_without_the_cpp_gemv_the_torch_ops_run(tiny_ckpt, monkeypatch):
    monkeypatch.setattr(int4_gemv, "available", lambda: False)  # as on a CPU without VNNI: dense weights
    model = checkpoint.load(tiny_ckpt)
    prepare_model(model, parse_precision("int4"), num_slots=4)
    gpt = model.gpt
    assert gpt.fused_decode is None
    out = gpt.decode(torch.randn(2, gpt.cfg.hidden_size), filled_cache(gpt, torch.float32), [0, 1], [3, 7])
    assert out.shape == (2, gpt.cfg.hidden_size) and torch.isfinite(out).all()


@needs_ops
def test_narrow_steps_keep_to_one_thread_beside_the_audio_worker(tiny_ckpt):
    from chattts_serve.engine.config import EngineConfig
    from chattts_serve.engine.engine import Engine
    from chattts_serve.sampling_params import SamplingParams

    params = SamplingParams(seed=3, max_new_tokens=16, refine_text=False)
    codes = {}
    for overlap in ("on", "off"):
        config = EngineConfig.with_slots(2, precision="int4", audio_overlap=overlap)
        engine = Engine.from_pretrained(tiny_ckpt, config=config)
        assert engine.model.gpt.fused_decode.narrow_threads == (1 if overlap == "on" else 0)
        codes[overlap] = engine.synthesize(["Hello there."], params)[0].codes
    torch.testing.assert_close(codes["on"], codes["off"], rtol=0, atol=0)  # the thread count changes no bits


@needs_ops
@pytest.mark.parametrize("rows", [1, 130])  # a decode step; a prefill's packed tokens (row blocks, parallel norm)
def test_the_step_applies_the_final_norm_with_torchs_bits(gpt, rows):
    """``run(normed=True)``: the model's final norm inside the step, ``gpt.norm``'s bits; it needs the weight."""
    from dataclasses import replace

    cache, cfg = filled_cache(gpt, torch.int8), gpt.cfg
    assert gpt.fused_decode.final_norm is not None and gpt.fused_decode.applies(cache.k)  # (loads the attention op)
    gen = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, cfg.hidden_size, generator=gen)
    cos, sin = torch.randn(rows, cfg.head_dim, generator=gen), torch.randn(rows, cfg.head_dim, generator=gen)
    slots = torch.randint(0, 4, (rows,), generator=gen)
    pos = torch.randint(POSITIONS, 64, (rows,), generator=gen)
    if rows > 1:
        slots, pos = torch.arange(rows) % 4, torch.arange(rows) // 4  # four prompts of ~33 tokens, interleaved
    args = (h, cos, sin, cache.k, cache.v, (cache.k_scale, cache.v_scale), slots, pos)
    normed = gpt.fused_decode.run(*args, normed=True)
    torch.testing.assert_close(normed, gpt.norm(gpt.fused_decode.run(*args)), rtol=0, atol=0)
    with pytest.raises(ValueError, match="final_norm"):
        replace(gpt.fused_decode, final_norm=None).run(*args, normed=True)


@needs_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_kept_rows_are_theirs_of_the_whole_call_and_every_key_is_written(gpt, dtype):
    """``run(keep=...)`` (a prefill wanting each prompt's last row): the kept rows' outputs, in keep's order, are
    their rows of the call without it, to the bit, and the cache holds every row's keys and values as it does."""
    cache, cfg = filled_cache(gpt, dtype), gpt.cfg
    rows = 131  # 130 real rows (four prompts of ~33 tokens, interleaved) and a padding row
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(rows, cfg.hidden_size, generator=gen)
    cos, sin = torch.randn(rows, cfg.head_dim, generator=gen), torch.randn(rows, cfg.head_dim, generator=gen)
    slots, pos = torch.arange(rows - 1) % 4, torch.arange(rows - 1) // 4
    scales = (cache.k_scale, cache.v_scale) if dtype == torch.int8 else None
    whole_cache, kept_cache = clone_cache(gpt, cache), clone_cache(gpt, cache)
    keep = torch.tensor([129, 126, 127, 128, 3, 64])  # each prompt's last row, two more, out of order
    step = gpt.fused_decode

    def run(c, **kw):
        s = (c.k_scale, c.v_scale) if scales is not None else None
        return step.run(h, cos, sin, c.k, c.v, s, slots, pos, normed=True, **kw)

    whole, kept = run(whole_cache), run(kept_cache, keep=keep)
    assert kept.shape == (len(keep), cfg.hidden_size)
    torch.testing.assert_close(kept, whole[keep], rtol=0, atol=0)
    for name, buf in whole_cache.named_buffers():
        assert torch.equal(getattr(kept_cache, name), buf), name
    assert run(clone_cache(gpt, cache), keep=torch.tensor([], dtype=torch.long)).shape == (0, cfg.hidden_size)
    with pytest.raises(RuntimeError, match="not a real row"):
        run(clone_cache(gpt, cache), keep=torch.tensor([130]))  # the padding row


@needs_ops
def test_a_call_on_one_thread_leaves_the_callers_count(gpt):
    from dataclasses import replace

    cache, cfg = filled_cache(gpt, torch.bfloat16), gpt.cfg
    one = replace(gpt.fused_decode, narrow_threads=1)
    h, cos = torch.randn(1, cfg.hidden_size), torch.ones(1, cfg.head_dim)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        wide = gpt.fused_decode.run(h, cos, cos, cache.k, cache.v, None, torch.tensor([0]), torch.tensor([5]))
        narrow = one.run(h, cos, cos, cache.k, cache.v, None, torch.tensor([0]), torch.tensor([5]))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(narrow, wide, rtol=0, atol=0)


@needs_ops
def test_only_a_narrow_step_on_one_thread_leaves_a_core_to_the_audio(tiny_ckpt):
    """The runner decodes audio beside a step only where the step keeps to one core (narrow, ``narrow_threads``);
    a wider step, or a prompt, uses every thread and the audio waits for it (on the engine thread)."""
    from chattts_serve.engine.config import EngineConfig
    from chattts_serve.engine.engine import Engine
    from chattts_serve.kernels.int4_decode import NARROW_ROWS

    for overlap, narrow_beside in (("on", True), ("off", False)):
        config = EngineConfig.with_slots(2, precision="int4", audio_overlap=overlap)
        path = Engine.from_pretrained(tiny_ckpt, config=config).runner.decode_path
        assert path.audio_beside(1) is narrow_beside and path.audio_beside(NARROW_ROWS) is narrow_beside
        assert path.audio_beside(NARROW_ROWS + 1) is False


@needs_ops
def test_audio_after_a_wide_step_decodes_on_the_engine_thread_and_sounds_the_same(tiny_ckpt, monkeypatch):
    """Ten texts of different lengths, int4 with overlap on: the windows finished beside the wide steps (more
    than ``NARROW_ROWS`` rows) decode on the engine thread, the last ones on the audio worker, and the codes and
    audio are overlap off's to the bit."""
    import threading

    import numpy as np

    from chattts_serve.audio import decode as decode_module
    from chattts_serve.engine.config import EngineConfig
    from chattts_serve.engine.engine import Engine
    from chattts_serve.sampling_params import SamplingParams

    where: list[str] = []
    real = decode_module._decode_batch

    def recorded(*a):
        where.append(threading.current_thread().name[:13])
        return real(*a)

    monkeypatch.setattr(decode_module, "_decode_batch", recorded)
    texts = [f"Hello number {i}." for i in range(10)]
    params = [
        SamplingParams(seed=i, refine_text=False, min_new_tokens=20 + 6 * i, max_new_tokens=20 + 6 * i)
        for i in range(10)
    ]
    results = {}
    for overlap in ("off", "on"):
        engine = Engine.from_pretrained(
            tiny_ckpt, config=EngineConfig.with_slots(10, precision="int4", audio_overlap=overlap)
        )
        where.clear()
        results[overlap] = engine.synthesize(texts, params)
        engine.close()
    assert "MainThread" in where and "chattts-audio" in where
    for a, b in zip(results["on"], results["off"], strict=True):
        np.testing.assert_array_equal(a.codes, b.codes)
        np.testing.assert_array_equal(a.audio, b.audio)
