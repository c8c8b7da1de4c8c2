"""Streaming audio: turn GPT steps into PCM in windows while the GPT is still generating, in O(n).

Each utterance has an ``AudioStream``. When enough new steps have arrived, it asks for one *window*:
the new steps to emit plus ``left_context`` steps before them and ``lookahead`` steps after (the
Decoder and Vocos are non-causal convolutions: a sample depends on about +-50 steps, but the weight of
far steps decays fast, so a few steps of margin make the window's samples match a one-shot decode of
the whole utterance to well above 40 dB). Each window is decoded once; nothing is ever decoded again
from the start. Consecutive chunks overlap by ``crossfade`` samples, blended linearly, so joins have
no steps. The samples emitted over the whole stream are exactly as many as a one-shot decode gives
(512 * steps - 256) and in the same places.

Chunk sizes start small (``first_chunk`` steps, for a fast first byte) and double up to ``max_chunk``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..models.chattts.config import SAMPLES_PER_TOKEN
from .policy import StreamPolicy


@dataclass(frozen=True, slots=True)
class Window:
    """Decode steps [start, end) of a stream; keep samples [keep_from, keep_to) of the window output
    (window sample i is utterance sample 512 * start + i)."""

    stream: AudioStream
    start: int
    end: int
    keep_from: int
    keep_to: int
    emit_to_step: int
    final: bool

    @property
    def num_steps(self) -> int:
        return self.end - self.start


class AudioStream:
    """Collects one utterance's steps (hidden states or codes) and plans its windows."""

    def __init__(
        self,
        policy: StreamPolicy,
        hidden_size: int,
        max_steps: int,
        device: torch.device,
        hidden: torch.Tensor | None = None,
    ) -> None:
        """``hidden``: the ``[max_steps, hidden_size]`` fp32 buffer to keep the steps in (the engine's
        shared ``engine.hidden_store`` row, which the engine writes itself); None: a buffer of its own."""
        self.policy = policy
        if hidden is None:
            hidden = torch.empty(max_steps, hidden_size, dtype=torch.float32, device=device)
        elif hidden.shape != (max_steps, hidden_size) or hidden.dtype != torch.float32:
            want = f"({max_steps}, {hidden_size}) fp32"
            raise ValueError(f"hidden buffer {tuple(hidden.shape)} {hidden.dtype}: want {want}")
        self.hidden = hidden
        self.codes: list[tuple[int, ...]] = []
        self.num_steps = 0
        self.emitted_steps = 0  # steps whose samples have been emitted
        self.emitted_samples = 0
        self.finished = False
        self.next_chunk = policy.first_chunk
        self._tail: np.ndarray | None = None  # decoded overlap past the last chunk, to crossfade

    def push(self, code: tuple[int, ...], hidden: torch.Tensor | None = None) -> int:
        """Add one step; returns its index. ``hidden`` None: the caller writes ``self.hidden[index]``
        (the engine writes a whole step's streams at once, ``engine.hidden_store``)."""
        step = self.num_steps
        if step >= self.hidden.shape[0]:
            raise ValueError(f"stream is full: {step} steps")
        if hidden is not None:
            self.hidden[step] = hidden
        self.codes.append(code)
        self.num_steps += 1
        return step

    def finish(self) -> None:
        self.finished = True

    @property
    def total_samples(self) -> int:
        """Samples a one-shot decode of the steps so far gives."""
        return max(SAMPLES_PER_TOKEN * self.num_steps - SAMPLES_PER_TOKEN // 2, 0)

    @property
    def done(self) -> bool:
        return self.finished and self.emitted_steps >= self.num_steps

    def next_window(self) -> Window | None:
        p, e, n = self.policy, self.emitted_steps, self.num_steps
        if self.finished:
            if e >= n:
                return None
            chunk_end = n
        elif n - e >= self.next_chunk + p.lookahead:
            chunk_end = e + self.next_chunk
        else:
            return None
        final = self.finished and chunk_end == n
        start = max(0, e - p.left_context)
        end = n if final else min(n, chunk_end + p.lookahead)
        keep_from = (e - start) * SAMPLES_PER_TOKEN
        if final:
            keep_to = (end - start) * SAMPLES_PER_TOKEN - SAMPLES_PER_TOKEN // 2
        else:
            keep_to = (chunk_end - start) * SAMPLES_PER_TOKEN + p.crossfade
        return Window(self, start, end, keep_from, keep_to, chunk_end, final)

    def accept(self, window: Window, samples: np.ndarray) -> np.ndarray:
        """Take a window's decoded samples; returns the new PCM to emit (crossfaded)."""
        kept = samples[window.keep_from : window.keep_to]
        if self._tail is not None and len(self._tail):
            k = min(len(self._tail), len(kept))
            fade = np.linspace(0.0, 1.0, k + 2, dtype=np.float32)[1:-1]
            kept = kept.copy()
            kept[:k] = self._tail[:k] * (1.0 - fade) + kept[:k] * fade
        if window.final:
            out, self._tail = kept, None
        else:
            cf = self.policy.crossfade
            out, self._tail = (kept[:-cf], kept[-cf:]) if cf else (kept, None)
        self.emitted_steps = window.emit_to_step
        self.emitted_samples += len(out)
        self.next_chunk = min(self.next_chunk * 2, self.policy.max_chunk)
        return out
