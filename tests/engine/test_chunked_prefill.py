"""Chunked prefill through the model runner and the engine (engine/runner.py, engine/prefill_runner.py,
engine/scheduler.py): a prompt prefilled in chunks over several steps gives the first token, hidden state and
keys of its one-shot prefill, to the bit, in every batch-invariant mode; and in the engine, a stream keeps
taking a token every step while a long prompt goes in beside it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chattts_serve import Engine, SamplingParams
from chattts_serve.engine.config import EngineConfig, RunnerConfig
from chattts_serve.engine.outputs import PrefillChunk, SchedulerOutput
from chattts_serve.engine.plan import PREFILL_BLOCK, resolve_plan
from chattts_serve.engine.request import Sequence
from chattts_serve.engine.runner import ModelRunner, SeqInputs, StepSampling
from chattts_serve.engine.scheduler import SchedulerConfig
from tests.support.tiny_model import prepared

SPK_ID, TEXT_EOS, MAX_LEN, SLOTS = 7, 3, 256, 4


def _runner(tiny_ckpt, mode: str, onnx_cache_dir: str) -> ModelRunner:
    """``mode``: a precision, or ``PRECISION/kv-int8`` (that precision over an int8 KV cache)."""
    precision, _, kv = mode.partition("/kv-")
    model, layout = prepared(tiny_ckpt, precision, SLOTS, onnx_cache_dir=onnx_cache_dir)
    plan = resolve_plan(EngineConfig(precision=precision, runner=RunnerConfig(kv_cache_dtype=kv or "auto")), "cpu")
    assert plan.chunked_prefill(SLOTS) == PREFILL_BLOCK
    return ModelRunner(model, layout, SLOTS, MAX_LEN, TEXT_EOS, plan, 2048, plan.chunked_prefill(SLOTS))


def _sequences(runner: ModelRunner) -> list[Sequence]:
    """Long prompts: text with a speaker and 60 voice-sample codes after it (a chunk boundary falls in the
    codes), text alone, and a refine (text) pass."""
    cfg = runner.model.config.gpt
    gen = torch.Generator().manual_seed(3)

    def ids(n: int) -> list[int]:
        out = torch.randint(10, cfg.num_text_tokens, (n,), generator=gen).tolist()
        out[1] = out[90 % n] = SPK_ID
        return out

    speaker = torch.randn(cfg.hidden_size, generator=gen)
    codes = torch.randint(0, cfg.num_audio_tokens - 1, (60, cfg.num_vq), generator=gen)
    sampling = StepSampling((0.3,), 0.7, 20, 1.05, seed=5)
    inputs = [
        ("code", SeqInputs(ids(100), sampling, speaker / speaker.norm(), SPK_ID, prompt_codes=codes)),
        ("code", SeqInputs(ids(131), sampling)),
        ("text", SeqInputs(ids(70), StepSampling((0.7,), 0.7, 20, 1.0, seed=6), speaker / speaker.norm(), SPK_ID)),
    ]
    seqs = []
    for slot, (kind, inp) in enumerate(inputs):
        n = len(inp.ids) + (0 if inp.prompt_codes is None else len(inp.prompt_codes))
        s = Sequence("r", kind, n, 0, 8, 625 if kind == "code" else TEXT_EOS, True, False, payload=inp)
        s.slot = slot
        seqs.append(s)
    return seqs


MODES = ["fp32", "bf16", "int8", "int8-static", "ort-fp32", "ort-int4", "fp32/kv-int8", "int8-static/kv-int8"]


@pytest.mark.parametrize("precision", MODES)
def test_chunk_prefilled_request_equals_one_shot(tiny_ckpt, onnx_cache_dir, precision):
    """Chunks of one block, side by side for three prompts (one ends each step at its own length), then
    each prompt's last chunk: the same first tokens, hidden states and cache as the prompts prefilled whole."""
    if precision.startswith("ort-"):
        pytest.importorskip("onnxruntime", reason="the ort-* precisions need the [onnx] extra")
    whole = _runner(tiny_ckpt, precision, onnx_cache_dir)
    one_shot = _sequences(whole)
    want = whole.execute(SchedulerOutput(prefill=one_shot))

    chunked = _runner(tiny_ckpt, precision, onnx_cache_dir)
    seqs = _sequences(chunked)
    got_tokens, got_hidden = {}, {}
    done = {s.seq_id: 0 for s in seqs}
    while any(done[s.seq_id] < s.prompt_len for s in seqs):
        sched = SchedulerOutput()
        for s in seqs:
            start = done[s.seq_id]
            if start >= s.prompt_len:
                continue
            end = min(start + PREFILL_BLOCK, s.prompt_len)
            if end < s.prompt_len:
                sched.partial.append(PrefillChunk(s, start, end))
            else:
                sched.prefill.append(s)
                sched.prefill_from[s.seq_id] = start
            done[s.seq_id] = end
        out = chunked.execute(sched)
        assert set(out.tokens) == {s.seq_id for s in sched.prefill}, "only a prompt's last chunk samples"
        got_tokens.update(out.tokens)
        got_hidden.update({s.seq_id: out.hidden_of(s.seq_id) for s in sched.prefill if s.kind == "code"})
    for a, b in zip(seqs, one_shot, strict=True):
        assert got_tokens[a.seq_id] == want.tokens[b.seq_id], (precision, a.prompt_len)
        if a.kind == "code":
            assert torch.equal(got_hidden[a.seq_id], want.hidden_of(b.seq_id))
        n = a.prompt_len
        c, w = chunked.cache, whole.cache
        pairs = [(c.k, w.k), (c.v, w.v)] + ([(c.k_scale, w.k_scale), (c.v_scale, w.v_scale)] if c.quantized else [])
        for kv, kv_whole in pairs:  # an int8 cache: its bytes and scales alike
            assert torch.equal(kv[:, a.slot, :, :n], kv_whole[:, a.slot, :, :n]), (precision, n)


# ------------------------------------------------------------------ the engine

LONG = "今天天气很好，我们一起去公园散步吧，然后在湖边坐一会儿，看看风景，再去吃一顿很好吃的晚饭，最后慢慢走回家。" * 2
PARAMS = SamplingParams(seed=11, min_new_tokens=10, max_new_tokens=10, refine_text=False)
STREAM = SamplingParams(seed=3, min_new_tokens=60, max_new_tokens=60, refine_text=False)


@pytest.fixture(scope="module", params=[("rows", "off"), ("static", "on"), ("onnx", "off")])
def chunking_engine(request, tiny_ckpt, onnx_cache_dir):
    """Four slots and a budget of one block: every prompt longer than 64 goes in chunks beside a stream. The
    decode paths: rows; the static step with the host one step ahead (CUDA's defaults, run on the CPU); ORT."""
    decode, ahead = request.param
    precision = "ort-fp32" if decode == "onnx" else "fp32"
    if decode == "onnx":
        pytest.importorskip("onnxruntime", reason="the ort-* precisions need the [onnx] extra")
    runner = RunnerConfig(decode="auto" if decode == "onnx" else decode, onnx_cache_dir=onnx_cache_dir)
    scheduler = SchedulerConfig(max_num_seqs=4, max_prefill_tokens=PREFILL_BLOCK)
    config = EngineConfig(scheduler=scheduler, runner=runner, precision=precision, host_ahead=ahead)
    engine = Engine.from_pretrained(tiny_ckpt, config=config)
    assert engine.plan.decode == decode and engine.plan.host_ahead == (ahead == "on")
    return engine


def test_a_stream_takes_a_token_every_step_while_a_long_prompt_prefills(chunking_engine):
    engine = chunking_engine
    core = engine.core
    assert core.scheduler.config.prefill_chunk == PREFILL_BLOCK and engine.plan.prefill_chunk == PREFILL_BLOCK
    [alone] = engine.synthesize(LONG, PARAMS)  # nothing decodes beside it: prefilled whole

    core.add_request("stream", core.prepare("你好。", STREAM))
    schedules = []
    schedule = core.scheduler.schedule

    def recording(*args, **kw):
        out = schedule(*args, **kw)
        schedules.append(out)
        return out

    core.scheduler.schedule = recording
    try:
        while not (core.scheduler.running and core.scheduler.running[0].tokens):  # the stream decodes
            core.step()
        [stream] = core.scheduler.running
        core.add_request("long", core.prepare(LONG, PARAMS))
        first = len(schedules)
        outputs = []
        while core.has_unfinished():
            outputs += core.step()
    finally:
        core.scheduler.schedule = schedule
    long_seqs = {c.seq for out in schedules[first:] for c in out.chunks() if c.seq.request_id == "long"}
    chunked = [s for s in long_seqs if s.prompt_len > PREFILL_BLOCK]
    assert chunked, "a sentence of the long text is longer than the budget"
    for seq in chunked:
        steps = [out for out in schedules[first:] if any(c.seq is seq for c in out.chunks())]
        assert len(steps) == -(-seq.prompt_len // PREFILL_BLOCK) > 1, "the long prompt went in chunks"
        for out in steps:
            assert stream in out.decode, "the stream decodes every step of the long prompt's prefill"
            assert sum(c.length for c in out.chunks()) <= PREFILL_BLOCK
    [final] = [o for o in outputs if o.request_id == "long" and o.finished]
    np.testing.assert_array_equal(np.concatenate([s.codes for s in final.segments]), alone.codes)


def test_a_request_aborted_mid_prefill_frees_its_slot_and_leaves_nothing_behind(chunking_engine):
    """Aborted between two chunks: it ends "aborted", its slot is free again, the stream goes on, and the next
    request prefilled into that slot gets the codes it gets alone (the half-written prompt does not leak)."""
    engine = chunking_engine
    core = engine.core
    [alone] = engine.synthesize(LONG, PARAMS)
    core.add_request("stream2", core.prepare("你好。", STREAM))
    while not (core.scheduler.running and core.scheduler.running[0].tokens):
        core.step()
    [stream] = core.scheduler.running
    core.add_request("cut", core.prepare(LONG, PARAMS))
    while not any(s.request_id == "cut" and s.prefilling and s.num_prefilled for s in core.scheduler.running):
        core.step()
    free = core.scheduler.num_free_slots
    assert core.abort("cut")
    ended = [o for o in core.step() if o.request_id == "cut"]
    assert [(o.finished, o.finish_reason) for o in ended] == [(True, "aborted")]
    assert core.scheduler.num_free_slots == free + 1 and stream in core.scheduler.running
    core.add_request("again", core.prepare(LONG, PARAMS))
    outputs = []
    while core.has_unfinished():
        outputs += core.step()
    [final] = [o for o in outputs if o.request_id == "again" and o.finished]
    np.testing.assert_array_equal(np.concatenate([s.codes for s in final.segments]), alone.codes)
