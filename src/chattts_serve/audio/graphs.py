"""Decoder + Vocos as CUDA graphs, one per (window bucket, rows bucket), captured at start-up on the
audio stream: a window group's ~290 eager launches become one replay.

Bucketed windows (``decode.window_bucket``) repeat a few shapes, and their masked decode
(``decode.decode_frames``) takes each row's true frames as a device tensor: no host value, so it can be
captured. Each graph reads a static input ``[rows, steps, hidden]`` (one buffer per window bucket, its
rows sliced: the graphs of one bucket run one at a time on the audio stream) and the rows' frames, and
writes a static output, cloned at once (the next replay of the same graph, even within one submission,
would overwrite it). A group with more windows than the largest rows bucket replays in pieces; a
window longer than the largest bucket (a one-shot utterance) or a refused bucket runs eagerly.

Why the audio stream and a pool of its own: a graph replays the cuBLAS workspace of the stream it was
captured on, and graphs of one pool must not run at once; the audio graphs replay beside the step
graphs (the engine's capture stream and pool, ``engine.cuda_graph.GraphStore``), so they share
neither. Each graph is checked once against the eager decode at start-up; one that disagrees is
refused (kept, never replayed) and its bucket runs eagerly. The time and memory the captures took are
logged.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from ..device import on_device, pinned_copy
from ..engine.cuda_graph import capture_graph
from ..models.chattts.checkpoint import LoadedModel
from .decode import decode_frames, window_bucket
from .policy import StreamPolicy

logger = logging.getLogger(__name__)

ROWS = (1, 4, 16, 64)
"""Rows buckets: a group of G windows replays the smallest >= G (or pieces of the largest)."""


def stream_buckets(policy: StreamPolicy) -> list[int]:
    """Every window bucket a stream under ``policy`` can produce: from one step to its widest window
    (left context, the largest chunk and the lookahead)."""
    widest = policy.left_context + policy.max_chunk + policy.lookahead
    return sorted({window_bucket(n) for n in range(1, widest + 1)})


class AudioGraphs:
    def __init__(
        self, model: LoadedModel, stream: Any, dtype: str, lengths: list[int], rows: tuple[int, ...] = ROWS
    ) -> None:
        """``stream``: the audio stream (capture and replay); ``lengths``: the window buckets to capture."""
        self.model, self.stream, self.dtype = model, stream, dtype
        self.lengths, self.rows = sorted(lengths), tuple(sorted(rows))
        self.graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self.refused: dict[tuple[int, int], Any] = {}
        self._inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.capture_s = 0.0
        self.capture_bytes = 0
        self.replays = 0

    def capture_all(self, device: torch.device) -> None:
        """Every (bucket, rows) graph, largest first (one pool), each checked against the eager decode."""
        hidden = self.model.config.gpt.hidden_size
        cuda = device.type == "cuda"
        t0 = time.perf_counter()
        reserved = torch.cuda.memory_reserved(device) if cuda else 0
        pool = torch.cuda.graph_pool_handle() if cuda else None
        with on_device(device), torch.inference_mode():
            for length in reversed(self.lengths):
                top = self.rows[-1]
                h = torch.zeros(top, length, hidden, device=device)
                frames = torch.full((top,), 2 * length, dtype=torch.long, device=device)
                self._inputs[length] = (h, frames)
                for rows in reversed(self.rows):
                    self._capture(length, rows, pool)
        self.capture_s = time.perf_counter() - t0
        if cuda:
            self.capture_bytes = torch.cuda.memory_reserved(device) - reserved
        logger.info(
            "audio decode graphs: %d captured (%d refused) for %d window buckets x %d row buckets in %.1f s, %.0f MiB",
            len(self.graphs),
            len(self.refused),
            len(self.lengths),
            len(self.rows),
            self.capture_s,
            self.capture_bytes / 2**20,
        )

    def _capture(self, length: int, rows: int, pool: Any) -> None:
        h, frames = self._inputs[length]
        h, frames = h[:rows], frames[:rows]

        def fn() -> torch.Tensor:
            return decode_frames(self.model, h, self.dtype, frames)

        graph, out = capture_graph(fn, self.stream, pool)
        key = (length, rows)
        # The check: a random group of ragged windows, replayed and decoded eagerly.
        g = torch.Generator(device="cpu").manual_seed(length * 131 + rows)
        h.copy_(torch.randn(h.shape, generator=g).to(h.device))
        frames.copy_(torch.randint(1, length + 1, (rows,), generator=g).to(frames.device) * 2)
        graph.replay()
        want = fn()
        if out.shape == want.shape and torch.allclose(out, want, rtol=1e-3, atol=1e-4):
            self.graphs[key] = (graph, out)
        else:
            logger.warning("audio decode graph %s refused: its replay differs from the eager decode", key)
            self.refused[key] = graph

    @torch.inference_mode()  # the static buffers were made under it (at capture)
    def run(self, h: torch.Tensor, steps: list[int]) -> torch.Tensor | None:
        """Replay the graphs of ``h``'s bucket for a group ``[G, L, hidden]`` of windows of ``steps``
        true steps each: the audio ``[G, 512 * L - 256]`` (a tensor of its own), or None when the
        bucket has no graph (the caller decodes eagerly)."""
        g, length = h.shape[0], h.shape[1]
        if length not in self._inputs:
            return None
        frames = pinned_copy(torch.tensor(steps, dtype=torch.long) * 2, h.device)
        pieces = []
        top = self.rows[-1]
        for lo in range(0, g, top):
            n = min(top, g - lo)
            rows = next(r for r in self.rows if r >= n)
            entry = self.graphs.get((length, rows))
            if entry is None:
                return None
            graph, out = entry
            static_h, static_frames = self._inputs[length]
            static_h[:n].copy_(h[lo : lo + n])
            static_frames[:n].copy_(frames[lo : lo + n])
            if n < rows:  # rows past the group: finite, whole, ignored
                static_h[n:rows].zero_()
                static_frames[n:rows].fill_(2 * length)
            graph.replay()
            self.replays += 1
            pieces.append(out[:n].clone())
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
