"""Kokoro's decoder as CUDA graphs per (rows bucket, frame bucket), captured at start-up (``--cuda-graphs``).

What a graph holds: ``Decoder.spectra``, every convolution from the aligned text features to the predicted
spectrogram (where the time goes), on a batch padded to the bucket's rows and frames, each row's frame count a
device tensor (``DeviceLengths``: masks after every convolution, instance norms over each row's own frames).
What stays outside, per row and eager: the text side (ALBERT, durations, F0 and energy: each row's batch-1
values bit for bit, which the sine phase needs), the one host sync for the frame counts, the sine source with
its noise drawn from each utterance's own generator (``Generator.harmonics``: the graph reads its spectra as a
static input, so one generator per request still holds), and the per-row inverse STFTs.

A batch longer than the largest frame bucket, or one whose bucket's graph was refused, runs the eager decoder
(chosen before the source draws its noise). A row's waveform equals its batch-1 one within ``AUDIO_BOUND``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...engine.bucket_graphs import BucketGraphs, Static, length_buckets
from ...engine.cuda_graph import batch_buckets
from ...kernels.lengths import DeviceLengths
from .layers import Lengths

FRAMES = (64, 1024)
"""Frame buckets, smallest and largest (40 frames a second: 1.6 s to 25.6 s of speech)."""
MAX_WORK = 16384
"""The largest rows x frames captured (32 rows of 10 s): a capture holds its intermediates, ~6 GB here."""
AUDIO_BOUND = 1e-4
"""A row through the graphs' padded forward vs itself alone (fp32): masked instance-norm statistics round
otherwise than the per-row kernel. Measured on random checkpoints, waveforms peaking ~0.4: 1.5e-7 (tiny, 5 rows
of 3-19 phonemes), 2.8e-7 (full size, 3 rows of 12-50 phonemes, one CPU thread)."""


class KokoroGraphs:
    def __init__(self, model, max_rows: int, strict: bool = False, frames: tuple[int, int] = FRAMES,
                 max_work: int | None = MAX_WORK, capture: Callable | None = None) -> None:
        """``model``: a loaded ``KokoroModel`` (its decoder's dtype as it will serve); ``max_rows``: the most
        utterances a step hands the model (``--max-num-seqs``); ``capture``: see ``BucketGraphs``."""
        self.model = model
        self.generator = model.decoder.generator
        bf16 = model.decoder_dtype != torch.float32
        self.graphs = BucketGraphs(
            "kokoro decoder", model.device, self._forward, self._inputs, self._probe,
            rows=batch_buckets(max_rows), lengths=length_buckets(frames[1], frames[0]), max_work=max_work,
            strict=strict, tolerance=(1.6e-2, 1e-2) if bf16 else None, capture=capture,
        )

    def capture_all(self) -> KokoroGraphs:
        self.graphs.capture_all()
        return self

    def counters(self) -> dict[str, int]:
        return self.graphs.counters()

    # ------------------------------------------------------------------ the captured forward

    def _har_steps(self, frames: int) -> int:
        """The source spectra's steps for ``frames`` duration frames (the decoder doubles the rate first)."""
        return 2 * frames * self.generator.upsample_scale // self.generator.hop + 1

    def _inputs(self, rows: int, frames: int) -> Static:
        cfg, device = self.model.config, self.model.device
        f32 = {"device": device, "dtype": torch.float32}
        return {
            "asr": torch.zeros(rows, cfg.hidden_dim, frames, **f32),
            "f0": torch.zeros(rows, 2 * frames, **f32),
            "energy": torch.zeros(rows, 2 * frames, **f32),
            "style": torch.zeros(rows, cfg.style_dim, **f32),
            "har": torch.zeros(rows, self.generator.n_fft + 2, self._har_steps(frames), **f32),
            "lengths": torch.ones(rows, dtype=torch.long, device=device),
        }

    def _forward(self, s: Static) -> torch.Tensor:
        frames = DeviceLengths(s["lengths"], s["asr"].shape[-1])
        return self.model.decoder.spectra(s["asr"], s["f0"], s["energy"], s["style"], frames, s["har"])

    def _probe(self, s: Static, frames: int, gen: torch.Generator) -> None:
        """A random ragged batch: features zero past each row's end, F0 in a voice's range."""
        lengths = s["lengths"]
        lengths.copy_(torch.randint(1, frames + 1, lengths.shape, generator=gen, device=gen.device))
        lengths[0] = frames  # one row fills the bucket
        rows = DeviceLengths(lengths, frames)
        s["asr"].normal_(generator=gen).mul_(rows.mask(lengths.device, torch.float32))
        twice = rows.scaled(2).mask(lengths.device, torch.float32)[:, 0]
        s["f0"].uniform_(80, 280, generator=gen).mul_(twice)
        s["energy"].normal_(generator=gen).mul_(twice)
        har = rows.scaled(2 * self.generator.upsample_scale // self.generator.hop, extra=1)
        s["har"].normal_(generator=gen).mul_(har.mask(lengths.device, torch.float32))
        s["style"].normal_(generator=gen)

    # ------------------------------------------------------------------ serving

    def decode(self, side: Any, generators: Sequence[torch.Generator | None]) -> list[torch.Tensor] | None:
        """``Decoder.forward`` for a text side (``model._TextSide``) through the graphs: one waveform per row,
        or None (nothing drawn yet) when the batch has no graph: the caller runs the eager decoder."""
        frames: Lengths = side.frames
        n = len(frames)
        if not self.graphs.usable(n, frames.total):
            self.graphs.note_eager()
            return None
        at = frames.scaled(2)
        har = self.generator.harmonics(side.f0, at, list(generators))
        lengths = frames.lengths.to(self.model.device)
        f, h = frames.total, har.shape[-1]

        def write(s: Static, lo: int, m: int) -> None:
            s["asr"][:m, :, :f].copy_(side.asr[lo : lo + m])
            s["f0"][:m, : 2 * f].copy_(side.f0[lo : lo + m])
            s["energy"][:m, : 2 * f].copy_(side.energy[lo : lo + m])
            s["style"][:m].copy_(side.decoder_style[lo : lo + m])
            s["har"][:m, :, :h].copy_(har[lo : lo + m])
            s["lengths"][:m].copy_(lengths[lo : lo + m])

        spectra = torch.cat(self.graphs.run(n, f, write))
        return self.generator.waveforms(spectra, self.generator.spectrum_lengths(at))
