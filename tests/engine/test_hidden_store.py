"""engine/hidden_store.py: a step's hidden states reach every stream's row with one write, rows are
reused once their stream is done, the store is sized once (headroom inside the slot bytes) and never
grows, and through the engine every window decodes the hidden states the
runner produced for its steps (what one write per stream gave before)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chattts_serve.audio.overlap import InlineStreams
from chattts_serve.audio.policy import StreamPolicy
from chattts_serve.engine.config import EngineConfig
from chattts_serve.engine.engine import Engine
from chattts_serve.engine.hidden_store import HiddenStore, rows_for
from chattts_serve.engine.outputs import StepOutput
from chattts_serve.engine.request import Sequence, SequenceStatus
from chattts_serve.engine.runner import slot_bytes
from chattts_serve.engine.scheduler import Scheduler, SchedulerConfig
from chattts_serve.models.chattts.config import GPTConfig
from chattts_serve.sampling_params import SamplingParams
from tests.support.cuda_stub import FakeCuda


def test_one_write_fills_every_streams_step():
    store = HiddenStore(hidden_size=3, max_steps=5, device=torch.device("cpu"), rows=3)
    rows = [store.acquire(5) for _ in range(3)]
    assert store.rows == 3 and store.rows_free == 0
    assert [h for h, _ in rows] == [0, 1, 2]
    step_hidden = torch.arange(12.0).view(4, 3)  # 4 rows this step, in some runner order
    # Streams 0 and 2 at step 0, stream 1 at step 3 (any step), row 3 of the step unused.
    for (handle, _), step, src in zip(rows, [0, 3, 0], [2, 0, 1], strict=True):
        store.stage(handle, step, src)
    store.write(step_hidden)
    views = [v for _, v in rows]
    assert torch.equal(views[0][0], step_hidden[2]) and torch.equal(views[1][3], step_hidden[0])
    assert torch.equal(views[2][0], step_hidden[1])
    assert not views[0][1:].any() and not views[1][:3].any()  # nothing else written
    store.write(None)  # nothing staged: nothing to do


def test_rows_are_reused_and_the_store_never_grows():
    store = HiddenStore(hidden_size=2, max_steps=4, device=torch.device("cpu"), rows=2)
    a, _ = store.acquire(4)
    b, view_b = store.acquire(2)
    assert view_b.shape == (2, 2)
    with pytest.raises(RuntimeError, match="rows is in use"):  # a growth would allocate mid-serving
        store.acquire(1)
    store.release(a)
    assert store.acquire(3)[0] == a and store.rows == 2
    with pytest.raises(ValueError, match="does not fit"):
        store.acquire(5)
    store.stage(b, 0, 0)
    with pytest.raises(RuntimeError, match="none given"):
        store.write(None)
    with pytest.raises(ValueError):
        HiddenStore(2, 0, torch.device("cpu"))


def test_rows_have_headroom_inside_the_slot_bytes():
    """The store is sized once, with room for streams whose slot has moved on, and every slot's bytes
    (what auto slots and a replica's budget divide memory by) pay for its share of that room."""
    assert rows_for(1) == 3 and rows_for(16) == 18 and rows_for(512) == 576
    for slots in (1, 16, 512):
        row = HiddenStore.bytes_per_row(768, 2304)
        assert slots * HiddenStore.bytes_per_slot(768, 2304) >= (rows_for(slots) - 2) * row
        store_bytes = rows_for(slots) * row
        assert slot_bytes(GPTConfig(), 2304, torch.float32) * slots >= store_bytes


def test_staged_indices_cross_from_pinned_memory_in_one_copy(monkeypatch):
    """On CUDA the step's destinations and sources go over in one non-blocking copy from the pinned
    staging buffer allocated with the store (no pageable copy, no allocation per step)."""
    calls = FakeCuda.install(monkeypatch)
    store = HiddenStore(hidden_size=2, max_steps=4, device=torch.device("cuda", 1), rows=4)
    assert calls.named("pinned") == [torch.device("cuda", 1)] * 2  # the two staging buffers, once
    copies = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(
        torch.Tensor,
        "copy_",
        lambda t, src, non_blocking=False: (
            copies.append((src.data_ptr() in {h.data_ptr() for h in store._staging.hosts}, non_blocking)),
            real_copy(t, src),
        )[1],
    )
    for step in range(3):
        handles = [store.acquire(4)[0] for _ in range(2)]
        for i, h in enumerate(handles):
            store.stage(h, step, i)
        store.write(torch.ones(2, 2))
        for h in handles:
            store.release(h)
    assert copies == [(True, True)] * 3
    assert calls.named("pinned") == [torch.device("cuda", 1)] * 2  # nothing pinned per step


def test_a_finished_stream_gives_its_row_back_before_earlier_sentences_are_emitted(tiny_ckpt):
    """Sentence 2 done (its last window decoded) while sentence 1 still speaks: its row is free at once,
    not when the request's in-order audio reaches it (which let a full engine with a queue hold more
    rows than slots, and the store grow mid-serving)."""
    engine = Engine.from_pretrained(tiny_ckpt, device="cpu", config=EngineConfig.with_slots(2))
    pipeline = engine.core.stage.pipeline
    p = SamplingParams(seed=1, refine_text=False, first_sentence_voice=False, max_new_tokens=8)
    prepared = engine.core.prepare("今天天气不错。我们去公园。", p)
    assert len(prepared.segments) == 2 and not prepared.voice_step
    first, second = pipeline.start("r", prepared, StreamPolicy.one_shot(), 0, 0.0)
    free = pipeline.hidden_store.rows_free
    hidden = torch.zeros(2, engine.model.config.gpt.hidden_size)
    tokens = (1, 2, 3, 4)
    first.tokens.append(tokens)
    second.tokens.append(tokens)
    second.status = SequenceStatus.FINISHED_LENGTH
    pipeline.update([StepOutput(first, tokens, 0), StepOutput(second, tokens, 1, finished=True)], hidden)
    assert pipeline.hidden_store.rows_free == free - 2
    windows = pipeline.windows()
    assert [w.final for _, _, w in windows] == [True]  # the second sentence's whole (one-shot) window
    pipeline.accept(windows, [np.zeros(512, np.float32)])
    assert pipeline.hidden_store.rows_free == free - 1  # back before the first sentence is done
    assert pipeline.outputs() == []  # and its audio still waits for the first sentence's


def test_no_code_sequence_is_admitted_without_a_row():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_model_len=64))
    seqs = [Sequence(f"r{i}", kind, 4, 0, 8, 0, False, False) for i, kind in enumerate(["code", "text", "code"])]
    for s in seqs:
        sched.add(s)
    out = sched.schedule(code_room=1)
    assert [s.request_id for s in out.prefill] == ["r0", "r1"]  # the second code sequence waits, in order
    assert [s.request_id for s in sched.schedule(code_room=1).prefill] == ["r2"]


class _Late:
    """An audio submission done only at its third look (a device behind the host)."""

    def __init__(self) -> None:
        self.looks = 0

    def query(self) -> bool:
        self.looks += 1
        return self.looks > 2

    def synchronize(self) -> None:
        pass


class LateStreams(InlineStreams):
    def record(self, stream):
        return _Late()


def test_a_full_engine_with_a_queue_never_grows_the_store(tiny_ckpt):
    """Audio collected steps after it was submitted (as on a busy device): streams outlive their slots,
    and new code sequences wait for a row instead of growing the store."""
    config = EngineConfig.with_slots(2, audio_overlap="on")
    engine = Engine.from_pretrained(tiny_ckpt, device="cpu", config=config)
    core, store = engine.core, engine.core.stage.pipeline.hidden_store
    core.stage.decoder.streams = LateStreams()
    block = store.block
    for i in range(6):
        p = SamplingParams(seed=i, refine_text=False, min_new_tokens=6 + 3 * i, max_new_tokens=6 + 3 * i)
        core.add_request(f"r{i}", core.prepare("今天天气不错。我们去公园。明天见。", p), StreamPolicy())
    most = 0
    while core.has_unfinished():
        core.step()
        most = max(most, store.rows - store.rows_free)
    assert store.block is block and store.rows == rows_for(2) and store.rows_free == store.rows
    assert most > 2  # streams outlived their slots, inside the headroom


def test_engine_windows_read_the_runners_hidden_states(tiny_ckpt):
    """More requests than slots (rows reused), streaming and one-shot: at every submission each
    window's rows are exactly the hidden states the runner returned for those steps."""
    engine = Engine.from_pretrained(tiny_ckpt, device="cpu", config=EngineConfig.with_slots(3))
    core = engine.core
    produced: dict = {}  # stream (kept alive: ids are not reused) -> its steps' hidden states
    update, submit = core.stage.pipeline.update, core.stage.decoder.submit

    def recording_update(outputs, hidden=None):
        segs = {o.seq.seq_id: core.stage.pipeline._by_seq.get(o.seq.seq_id) for o in outputs}
        follow = update(outputs, hidden)
        for o in outputs:
            if o.hidden_row is not None and segs[o.seq.seq_id] is not None:
                stream = segs[o.seq.seq_id][1].stream
                produced.setdefault(stream, []).append(hidden[o.hidden_row].clone())
        return follow

    checked = []

    def checking_submit(entries, **kw):
        for _, _, w in entries:
            want = torch.stack(produced[w.stream][w.start : w.end])
            assert torch.equal(w.stream.hidden[w.start : w.end], want)
            checked.append(w.final)
        return submit(entries, **kw)

    core.stage.pipeline.update, core.stage.decoder.submit = recording_update, checking_submit
    for i in range(5):
        p = SamplingParams(seed=i, min_new_tokens=30 + 7 * i, max_new_tokens=30 + 7 * i, refine_text=False)
        policy = StreamPolicy() if i % 2 else StreamPolicy.one_shot()
        core.add_request(f"r{i}", core.prepare("hello there", p), policy)
    finished = 0
    while core.has_unfinished():
        finished += sum(o.finished for o in core.step())
    assert finished == 5 and sum(checked) == 5 and len(checked) > 5  # every final window, and chunks
    assert core.stage.pipeline.hidden_store.rows_free == core.stage.pipeline.hidden_store.rows  # all given back
