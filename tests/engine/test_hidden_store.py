"""engine/hidden_store.py: a step's hidden states reach every stream's row with one write, rows are
reused once their stream is done, and through the engine every window decodes the hidden states the
runner produced for its steps (what one write per stream gave before)."""

from __future__ import annotations

import pytest
import torch

from chattts_serve.audio.policy import StreamPolicy
from chattts_serve.engine.config import EngineConfig
from chattts_serve.engine.engine import Engine
from chattts_serve.engine.hidden_store import HiddenStore
from chattts_serve.sampling_params import SamplingParams


def test_one_write_fills_every_streams_step_across_blocks():
    store = HiddenStore(hidden_size=3, max_steps=5, device=torch.device("cpu"), first_rows=2)
    rows = [store.acquire(5) for _ in range(3)]  # the third grows a second block
    assert len(store.blocks) == 2 and store.rows == 4 and store.rows_free == 1
    assert [h for h, _ in rows] == [(0, 0), (0, 1), (1, 0)]
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


def test_rows_are_reused_and_bad_use_is_refused():
    store = HiddenStore(hidden_size=2, max_steps=4, device=torch.device("cpu"), first_rows=2)
    a, _ = store.acquire(4)
    b, view_b = store.acquire(2)
    assert view_b.shape == (2, 2)
    store.release(a)
    assert store.acquire(3)[0] == a and len(store.blocks) == 1  # no growth while a row is free
    with pytest.raises(ValueError, match="does not fit"):
        store.acquire(5)
    store.stage(b, 0, 0)
    with pytest.raises(RuntimeError, match="none given"):
        store.write(None)
    with pytest.raises(ValueError):
        HiddenStore(2, 0, torch.device("cpu"))


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

    def checking_submit(entries):
        for _, _, w in entries:
            want = torch.stack(produced[w.stream][w.start : w.end])
            assert torch.equal(w.stream.hidden[w.start : w.end], want)
            checked.append(w.final)
        return submit(entries)

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
