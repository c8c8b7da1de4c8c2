"""VITS's flow and HiFi-GAN decoder as CUDA graphs per (rows bucket, frame bucket), captured at start-up
(``--cuda-graphs``).

What a graph holds: steps 4-5 of ``VitsModel`` (the flow in reverse, then the decoder), where the time goes, on a
group of rows padded to the bucket's rows and frames, each row's frame count a device tensor (``DeviceLengths``:
the same masks after every convolution as the host path). What stays outside, per row and eager: the text side
and the duration predictor (each row's durations bit for bit), the one host sync for the frame counts, and both
noise draws, from each utterance's own generator: the graph reads the prior with its noise already added as a
static input, so a seed still reproduces ``torch.manual_seed(s)`` before transformers' forward.

A group longer than the largest frame bucket, one whose bucket's graph was refused, or (multi-speaker
checkpoints) a group without a speaker, runs eagerly. A row's waveform equals its batch-1 one within float
rounding of the padded convolutions (the bound of the padded eager path).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ...engine.bucket_graphs import BucketGraphs, Static, length_buckets
from ...engine.cuda_graph import batch_buckets
from ...kernels.lengths import DeviceLengths

FRAMES = (64, 2048)
"""Frame buckets, smallest and largest (62.5 frames a second at MMS's 16 kHz: 1 s to 33 s of speech)."""
MAX_WORK = 32768
"""The largest rows x frames captured (32 rows of 16 s)."""


class VitsGraphs:
    def __init__(self, model, max_rows: int, strict: bool = False, frames: tuple[int, int] = FRAMES,
                 max_work: int | None = MAX_WORK, capture: Callable | None = None) -> None:
        """``model``: a loaded ``VitsModel`` in the dtype it will serve (``decode_dtype``); ``max_rows``: the most
        utterances a step hands the model; ``capture``: see ``BucketGraphs``."""
        self.model = model
        self.speakers = model.config.num_speakers > 1
        bf16 = model.decode_dtype != torch.float32
        self.graphs = BucketGraphs(
            "vits decoder", model.device, self._forward, self._inputs, self._probe,
            rows=batch_buckets(max_rows), lengths=length_buckets(frames[1], frames[0]), max_work=max_work,
            strict=strict, tolerance=(1.6e-2, 1e-2) if bf16 else None, capture=capture,
        )

    def capture_all(self) -> VitsGraphs:
        self.graphs.capture_all()
        return self

    def counters(self) -> dict[str, int]:
        return self.graphs.counters()

    def describe(self) -> dict:
        return self.graphs.describe()

    # ------------------------------------------------------------------ the captured forward

    def _inputs(self, rows: int, frames: int) -> Static:
        c, device, dtype = self.model.config, self.model.device, self.model.decode_dtype
        static = {
            "prior": torch.zeros(rows, c.flow_size, frames, device=device, dtype=dtype),
            "lengths": torch.ones(rows, dtype=torch.long, device=device),
        }
        if self.speakers:
            static["speaker"] = torch.zeros(rows, c.speaker_embedding_size, 1, device=device, dtype=dtype)
        return static

    def _forward(self, s: Static) -> torch.Tensor:
        prior, speaker = s["prior"], s.get("speaker")
        lengths = DeviceLengths(s["lengths"], prior.shape[-1])
        mask = lengths.mask(prior.device, prior.dtype)
        latent = self.model.flow.reverse(prior, mask, speaker) * mask
        return self.model.decoder(latent, lengths, speaker)

    def _probe(self, s: Static, frames: int, gen: torch.Generator) -> None:
        lengths = s["lengths"]
        lengths.copy_(torch.randint(1, frames + 1, lengths.shape, generator=gen, device=gen.device))
        lengths[0] = frames  # one row fills the bucket
        prior = s["prior"]
        prior.normal_(generator=gen).mul_(DeviceLengths(lengths, frames).mask(prior.device, prior.dtype))
        if "speaker" in s:
            s["speaker"].normal_(generator=gen)

    # ------------------------------------------------------------------ serving

    def decode(self, latents: Sequence, speaker: torch.Tensor | None) -> list[torch.Tensor] | None:
        """The waveforms [T * samples_per_frame] (on the CPU) of a group of ``Latent``s through the graphs, or None
        when the group has no graph (the caller decodes it eagerly). ``speaker``: [B, size, 1] or None."""
        counts = [lat.prior.shape[-1] for lat in latents]
        n, total = len(latents), max(counts)
        if (speaker is not None) != self.speakers or not self.graphs.usable(n, total):
            self.graphs.note_eager()
            return None
        lengths = torch.tensor(counts, dtype=torch.long).to(self.model.device)

        def write(s: Static, lo: int, m: int) -> None:
            for row in range(m):
                prior = latents[lo + row].prior
                s["prior"][row, :, : prior.shape[-1]].copy_(prior)
            s["lengths"][:m].copy_(lengths[lo : lo + m])
            if speaker is not None:
                s["speaker"][:m].copy_(speaker[lo : lo + m])

        audio = torch.cat(self.graphs.run(n, total, write))
        hop = self.model.config.samples_per_frame
        return [audio[row, : k * hop].float().cpu() for row, k in enumerate(counts)]
