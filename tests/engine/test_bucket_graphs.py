"""engine/bucket_graphs.py: the batch families' graphs per (rows bucket, length bucket): the buckets, capture
with a start-up self-check that refuses a graph differing from the eager forward, replays in pieces, eager
fallback past the largest bucket, and the counters; kernels/lengths.py: masks from device lengths."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from chattts_serve.engine.bucket_graphs import BucketGraphs, grid, length_buckets
from chattts_serve.kernels.lengths import DeviceLengths, masked_instance_norm
from tests.support.graph_capture import StandInCapture
from tests.support.host_syncs import host_syncs

CPU = torch.device("cpu")
WIDTH = 3


def test_length_buckets_and_the_grid():
    assert length_buckets(1024, 64) == [64, 128, 256, 512, 1024]
    assert length_buckets(1000, 64) == [64, 128, 256, 512, 1024]  # the largest holds ``largest``
    assert length_buckets(64, 64) == [64]
    with pytest.raises(ValueError, match="smallest"):
        length_buckets(32, 64)
    # largest first; rows x length within the work, the one-row bucket kept at every length
    assert grid([1, 2, 4], [16, 32], max_work=64) == [(2, 32), (1, 32), (4, 16), (2, 16), (1, 16)]
    assert grid([1, 2], [16], max_work=4) == [(1, 16)]
    assert len(grid([1, 2, 4], [16, 32], None)) == 6


def _forward(s):
    """A toy bucket-padded forward: a masked conv and a masked instance norm, as the families' are built."""
    lengths = DeviceLengths(s["lengths"], s["x"].shape[-1])
    mask = lengths.mask(s["x"].device, s["x"].dtype)
    h = F.conv1d(s["x"] * mask, torch.ones(WIDTH, WIDTH, 3) / 9, padding=1) * mask
    return masked_instance_norm(h, torch.ones(WIDTH), torch.zeros(WIDTH), lengths)


def _inputs(rows, length):
    return {"x": torch.zeros(rows, WIDTH, length), "lengths": torch.ones(rows, dtype=torch.long)}


def _probe(s, length, gen):
    lengths = torch.randint(1, length + 1, (s["x"].shape[0],), generator=gen)
    s["lengths"].copy_(lengths)
    for row, n in enumerate(lengths.tolist()):
        s["x"][row, :, :n] = torch.randn(WIDTH, n, generator=gen)


def _alone(x):
    """One unpadded row's result: the reference for every padded row."""
    h = F.conv1d(x[None], torch.ones(WIDTH, WIDTH, 3) / 9, padding=1)
    return F.instance_norm(h, use_input_stats=True, eps=1e-5)[0]


def _graphs(capture, **kw):
    return BucketGraphs("toy", CPU, _forward, _inputs, _probe, rows=[1, 2, 4], lengths=[8, 16], capture=capture, **kw)


def _run(graphs, xs):
    def write(s, lo, m):
        for row in range(m):
            x = xs[lo + row]
            s["x"][row, :, : x.shape[-1]] = x
            s["lengths"][row] = x.shape[-1]

    outs = torch.cat(graphs.run(len(xs), max(x.shape[-1] for x in xs), write))
    return [outs[row, :, : x.shape[-1]] for row, x in enumerate(xs)]


def test_capture_then_replays_give_each_row_its_unpadded_result():
    capture = StandInCapture()
    graphs = _graphs(capture)
    graphs.capture_all()
    assert set(graphs.graphs) == {(r, n) for r in (1, 2, 4) for n in (8, 16)} and graphs.refused == 0
    assert capture.shapes[0] == (4, WIDTH, 16)  # largest first
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(WIDTH, n, generator=gen) for n in (5, 11, 2, 16, 9)]
    got = _run(graphs, xs)  # 5 rows: 4 in the 4-row graph, then 1 in the 1-row graph, bucket 16
    assert graphs.counters() == {"graph_replays": 2, "eager_steps": 0, "graphs_refused": 0}
    assert len(capture.shapes) == 6  # nothing captured while serving
    for x, y in zip(xs, got, strict=True):
        torch.testing.assert_close(y, _alone(x), rtol=1e-5, atol=1e-5)
    report = graphs.describe()
    assert report["captured"] == 6 and report["refused"] == 0 and report["max_replay_vs_eager"] == 0.0
    assert graphs.pieces(3, 7) == [(0, 3, 4)]  # a short batch pads to the 8 bucket, 3 rows to 4
    assert graphs.pieces(9, 16) == [(0, 4, 4), (4, 4, 4), (8, 1, 1)]


def test_a_previous_batch_leaves_nothing_in_the_static_inputs():
    graphs = _graphs(StandInCapture())
    graphs.capture_all()
    long = [torch.full((WIDTH, 16), 5.0)] * 4
    _run(graphs, long)
    x = torch.randn(WIDTH, 4, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_run(graphs, [x])[0], _alone(x), rtol=1e-5, atol=1e-5)


def test_a_length_past_the_largest_bucket_is_not_usable():
    graphs = _graphs(StandInCapture())
    graphs.capture_all()
    assert graphs.usable(4, 16) and not graphs.usable(1, 17) and not graphs.usable(0, 4)
    with pytest.raises(ValueError, match="no graph"):
        graphs.run(1, 17, lambda s, lo, m: None)


def test_a_graph_that_differs_from_the_eager_forward_is_refused():
    graphs = _graphs(StandInCapture(works=False))  # replays write nothing: the check sees the NaN poison
    graphs.capture_all()
    assert not graphs.graphs and graphs.refused == 6 and len(graphs.store.retired) == 6
    assert not graphs.usable(1, 8)
    assert graphs.counters()["graphs_refused"] == 6
    with pytest.raises(RuntimeError, match="differ from the eager forward"):
        _graphs(StandInCapture(works=False), strict=True).capture_all()


def test_a_bucket_whose_capture_fails_is_refused_not_fatal():
    def failing_second():
        capture, calls = StandInCapture(), []

        def fn(call):
            calls.append(1)
            if len(calls) == 2:  # the second bucket's capture fails, as an op CUDA cannot capture would
                raise RuntimeError("operation not permitted when stream is capturing")
            return capture(call)

        return fn

    graphs = _graphs(failing_second())
    graphs.capture_all()
    assert graphs.refused == 1 and len(graphs.graphs) == 5 and (2, 16) not in graphs.graphs
    assert graphs.pieces(2, 16) == [(0, 2, 4)]  # the next wider graph of the bucket takes the refused one's rows
    with pytest.raises(RuntimeError, match="not permitted"):
        _graphs(failing_second(), strict=True).capture_all()


def test_the_padded_forward_has_no_host_sync():
    static = _inputs(4, 16)
    _probe(static, 16, torch.Generator().manual_seed(1))
    with torch.inference_mode():
        _, counts = host_syncs(lambda: _forward(static))
    assert not counts
    # and the host-length path it replaces does sync (the counter sees what it claims to)
    _, counts = host_syncs(lambda: static["lengths"].tolist() and static["lengths"].max().item())
    assert counts


def test_device_lengths_masks_and_scaling():
    lengths = DeviceLengths(torch.tensor([2, 4]), 4)
    assert lengths.ragged and len(lengths) == 2
    assert lengths.mask(CPU, torch.float32)[:, 0].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    up = lengths.scaled(2, extra=1)
    assert up.total == 9 and up.lengths.tolist() == [5, 9]
