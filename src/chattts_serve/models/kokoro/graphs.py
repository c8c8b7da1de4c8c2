"""Kokoro as CUDA graphs per bucket, captured at start-up (``--cuda-graphs``): three tables of them.

- **text** per (rows, token bucket): ALBERT, the duration encoder, the durations and the acoustic text encoder on
  a batch padded to the bucket (key-masked attention, LSTMs that stop at each row's end: ``masked_bilstm``);
- **curves** per (rows, frame bucket): F0 and energy from the frame-aligned encoding;
- **decoder** per (rows, frame bucket): ``Decoder.spectra``, every convolution from the aligned features to the
  predicted spectrogram (where the time goes).

Each row's lengths are a device tensor (``DeviceLengths``: masks after every convolution, instance norms over a
row's own frames), so padding stays invisible. Between and around the graphs, eager: the one host sync (the frame
counts, which fix the frame bucket), the alignment (a gather by the durations' running sums: no host value), the
sine source with its noise drawn from each utterance's own generator (``Generator.harmonics``: the decoder graph
reads its spectra as a static input, so one generator per request still holds), and the per-row inverse STFTs.

The text side as one padded forward is the model's ``prosody="batch"``: durations exact, F0 and energy within
float rounding, and the waveform within the drift that rounding makes in the sine source's phase
(``TEXT_AUDIO_BOUND``); with ``text=False`` the text side runs row by row as without graphs (bit for bit) and the
decoder alone is graphed (``AUDIO_BOUND``). A batch past the largest bucket of a table, or whose bucket's graph was
refused, runs that part eagerly (the decoder's choice is made before the source draws its noise).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...engine.bucket_graphs import BucketGraphs, Static, length_buckets
from ...engine.cuda_graph import GraphStore, batch_buckets
from ...kernels.lengths import DeviceLengths
from .layers import Lengths, masked, run_lstm

TOKENS = (16, 512)
"""Token buckets, smallest and largest (the model's context is 510 phonemes and the two boundaries)."""
FRAMES = (64, 1024)
"""Frame buckets, smallest and largest (40 frames a second: 1.6 s to 25.6 s of speech)."""
MAX_WORK = 16384
"""The decoder's largest rows x frames captured (32 rows of 10 s): a capture holds its intermediates, ~6 GB."""
AUDIO_BOUND = 1e-4
"""A row through the decoder's graphs vs itself alone (fp32, text side row by row): masked instance-norm statistics
round otherwise than the per-row kernel. Measured on random checkpoints, waveforms peaking ~0.4: 1.5e-7 (tiny, 5
rows of 3-19 phonemes), 2.8e-7 (full size, 3 rows of 12-50 phonemes, one CPU thread)."""
TEXT_AUDIO_BOUND = 5e-2
"""The same with the text side graphed too (``prosody="batch"``), on the tiny checkpoint the tests use: F0 moves by
float rounding, which the sine source integrates into a phase of ~1e4 radians, so the waveform drifts by more than
its rounding (measured 0.012 tiny; 0.10 at full size on peaks of 0.4, whose spectra stay within 0.023)."""
F0_RTOL, F0_ATOL = 1e-5, 1e-3
"""F0 and energy of a row of the padded text side vs alone (as ``prosody="batch"``)."""


class KokoroGraphs:
    def __init__(self, model, max_rows: int, strict: bool = False, frames: tuple[int, int] = FRAMES,
                 max_work: int | None = MAX_WORK, capture: Callable | None = None, text: bool = True,
                 tokens: tuple[int, int] = TOKENS) -> None:
        """``model``: a loaded ``KokoroModel`` (its decoder's dtype as it will serve); ``max_rows``: the most
        utterances a step hands the model (``--max-num-seqs``); ``text``: graph the text side and the curves too;
        ``capture``: see ``BucketGraphs``."""
        self.model = model
        self.generator = model.decoder.generator
        bf16 = model.decoder_dtype != torch.float32
        store = GraphStore(model.device)
        rows = batch_buckets(max_rows)
        frame_buckets = length_buckets(frames[1], frames[0])
        self.decoder = BucketGraphs(
            "kokoro decoder", model.device, self._forward, self._inputs, self._probe, rows=rows,
            lengths=frame_buckets, max_work=max_work, strict=strict, tolerance=(1.6e-2, 1e-2) if bf16 else None,
            store=store, capture=capture,
        )
        self.text: BucketGraphs | None = None
        self.curves: BucketGraphs | None = None
        if text:
            self.text = BucketGraphs(
                "kokoro text", model.device, self._text_forward, self._text_inputs, self._text_probe, rows=rows,
                lengths=length_buckets(tokens[1], tokens[0]), strict=strict, store=store, capture=capture,
            )
            self.curves = BucketGraphs(
                "kokoro curves", model.device, self._curves_forward, self._curves_inputs, self._curves_probe,
                rows=rows, lengths=frame_buckets, max_work=4 * max_work if max_work else None, strict=strict,
                store=store, capture=capture,
            )
        self.tables = [t for t in (self.text, self.curves, self.decoder) if t is not None]

    def capture_all(self) -> KokoroGraphs:
        for table in self.tables:
            table.capture_all()
        return self

    def counters(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for table in self.tables:
            for k, v in table.counters().items():
                out[k] = out.get(k, 0) + v
        return out

    def describe(self) -> dict[str, Any]:
        parts = {t.name: t.describe() for t in self.tables}
        diffs = [p["max_replay_vs_eager"] for p in parts.values() if p["max_replay_vs_eager"] is not None]
        return {"captured": sum(p["captured"] for p in parts.values()),
                "refused": sum(p["refused"] for p in parts.values()),
                "max_replay_vs_eager": max(diffs, default=None), "tables": parts}

    # ------------------------------------------------------------------ the text side (token buckets)

    def _text_inputs(self, rows: int, tokens: int) -> Static:
        device = self.model.device
        return {
            "ids": torch.zeros(rows, tokens, dtype=torch.long, device=device),
            "style": torch.zeros(rows, self.model.config.voice_dim, device=device),
            "speed": torch.ones(rows, device=device),
            "lengths": torch.ones(rows, dtype=torch.long, device=device),
        }

    def _text_forward(self, s: Static) -> torch.Tensor:
        """[rows, 1 + (hidden + style) + hidden, tokens]: each token's frames (as floats), the duration encoding
        (transposed) and the acoustic text encoding: what ``KokoroModel._text_side`` computes before the sync."""
        m, ids = self.model, s["ids"]
        tokens = DeviceLengths(s["lengths"], ids.shape[1])
        valid = tokens.mask(ids.device, torch.bool)[:, 0, :]
        prosody_style = s["style"][:, m.config.style_dim :]
        d_en = m.bert_encoder(m.bert(ids, valid)).transpose(-1, -2)
        d = m.predictor.text_encoder(d_en, prosody_style, tokens)
        x = run_lstm(m.predictor.lstm, d, tokens)
        total = torch.sigmoid(m.predictor.duration_proj.linear_layer(x)).sum(dim=-1)
        # Each row by its own speed (``ProsodyPredictor.durations``), a device value here; padding is 0 frames.
        frames = torch.round(total / s["speed"][:, None]).clamp(min=1)
        frames = torch.where(valid, frames, torch.zeros_like(frames))
        return torch.cat([frames[:, None, :], d.transpose(1, 2), m.text_encoder(ids, tokens)], dim=1)

    def _text_probe(self, s: Static, tokens: int, gen: torch.Generator) -> None:
        lengths = s["lengths"]
        lengths.copy_(torch.randint(3, max(tokens, 3) + 1, lengths.shape, generator=gen, device=gen.device))
        lengths[0] = tokens
        ids = torch.randint(1, self.model.config.n_token, s["ids"].shape, generator=gen, device=gen.device)
        s["ids"].copy_(ids * DeviceLengths(lengths, tokens).mask(ids.device, torch.long)[:, 0, :])
        s["style"].normal_(generator=gen)
        s["speed"].uniform_(0.8, 1.25, generator=gen)

    # ------------------------------------------------------------------ F0 and energy (frame buckets)

    def _curves_inputs(self, rows: int, frames: int) -> Static:
        cfg, device = self.model.config, self.model.device
        return {
            "en": torch.zeros(rows, cfg.hidden_dim + cfg.style_dim, frames, device=device),
            "style": torch.zeros(rows, cfg.style_dim, device=device),
            "lengths": torch.ones(rows, dtype=torch.long, device=device),
        }

    def _curves_forward(self, s: Static) -> torch.Tensor:
        """[rows, 2, 2 * frames]: F0 and energy."""
        frames = DeviceLengths(s["lengths"], s["en"].shape[-1])
        return torch.stack(self.model.predictor.curves(s["en"], s["style"], frames), dim=1)

    def _curves_probe(self, s: Static, frames: int, gen: torch.Generator) -> None:
        lengths = s["lengths"]
        lengths.copy_(torch.randint(1, frames + 1, lengths.shape, generator=gen, device=gen.device))
        lengths[0] = frames
        s["en"].normal_(generator=gen).mul_(DeviceLengths(lengths, frames).mask(lengths.device, torch.float32))
        s["style"].normal_(generator=gen)

    # ------------------------------------------------------------------ the decoder (frame buckets)

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

    def text_side(self, utterances: Sequence[Any]) -> Any:
        """``KokoroModel._text_side`` for the whole batch through the text and curves graphs (a ``_TextSide``),
        or None when there are no text graphs or none for the batch (the caller runs the text side eagerly)."""
        from .model import _TextSide

        if self.text is None:
            return None
        n, counts = len(utterances), [len(u.input_ids) for u in utterances]
        if not self.text.usable(n, max(counts)):
            self.text.note_eager()
            return None
        device, sd = self.model.device, self.model.config.style_dim
        ids = torch.zeros(n, max(counts), dtype=torch.long)
        for row, u in enumerate(utterances):
            ids[row, : counts[row]] = torch.as_tensor(list(u.input_ids), dtype=torch.long)
        ids = ids.to(device)
        ref = torch.stack([u.style.reshape(-1) for u in utterances]).to(device=device, dtype=torch.float32)
        speeds = torch.tensor([float(u.speed) for u in utterances]).to(device)
        token_lengths = torch.tensor(counts).to(device)
        t = max(counts)

        def write(s: Static, lo: int, m: int) -> None:
            s["ids"][:m, :t].copy_(ids[lo : lo + m])
            s["style"][:m].copy_(ref[lo : lo + m])
            s["speed"][:m].copy_(speeds[lo : lo + m])
            s["lengths"][:m].copy_(token_lengths[lo : lo + m])

        out = torch.cat(self.text.run(n, t, write))
        hidden = self.model.config.hidden_dim
        durations = out[:, 0, :].long()
        d, t_en = out[:, 1 : 1 + hidden + sd, :], out[:, 1 + hidden + sd :, :]
        frame_counts = durations.sum(dim=1).cpu()  # the one host sync: the frame count fixes the frame bucket
        frames = Lengths(frame_counts, int(frame_counts.max()))
        rows = DeviceLengths(frame_counts.to(device), frames.total)
        index = _frame_index(durations, frames.total)
        en, asr = _gather(d, index, rows), _gather(t_en, index, rows)
        f0, energy = self._curves(en, ref[:, sd:], rows)
        return _TextSide(durations, frames, asr, f0, energy, ref[:, :sd])

    def _curves(self, en: torch.Tensor, style: torch.Tensor, rows: DeviceLengths) -> tuple[torch.Tensor, torch.Tensor]:
        n, f = en.shape[0], rows.total
        if not self.curves.usable(n, f):  # past the largest bucket: the same padded forward, eagerly
            self.curves.note_eager()
            return self.model.predictor.curves(en, style, rows)

        def write(s: Static, lo: int, m: int) -> None:
            s["en"][:m, :, :f].copy_(en[lo : lo + m])
            s["style"][:m].copy_(style[lo : lo + m])
            s["lengths"][:m].copy_(rows.lengths[lo : lo + m])

        out = torch.cat(self.curves.run(n, f, write))
        return out[:, 0, : 2 * f], out[:, 1, : 2 * f]

    def decode(self, side: Any, generators: Sequence[torch.Generator | None]) -> list[torch.Tensor] | None:
        """``Decoder.forward`` for a text side (``model._TextSide``) through the graphs: one waveform per row,
        or None (nothing drawn yet) when the batch has no graph: the caller runs the eager decoder."""
        frames: Lengths = side.frames
        n = len(frames)
        if not self.decoder.usable(n, frames.total):
            self.decoder.note_eager()
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

        spectra = torch.cat(self.decoder.run(n, f, write))
        return self.generator.waveforms(spectra, self.generator.spectrum_lengths(at))


def _frame_index(durations: torch.Tensor, total: int) -> torch.Tensor:
    """[B, total]: the token each frame belongs to, from the durations' running sums on the device (no host
    value, unlike ``model._frame_to_token``); past a row's frames, its last token (masked after)."""
    ends = durations.cumsum(dim=1)
    steps = torch.arange(total, device=durations.device).expand(durations.shape[0], total).contiguous()
    return torch.searchsorted(ends, steps, right=True).clamp(max=durations.shape[1] - 1)


def _gather(x: torch.Tensor, index: torch.Tensor, rows: DeviceLengths) -> torch.Tensor:
    """Token-rate [B, C, T] -> frame-rate [B, C, F], each frame a copy of its token's vector, zero past the end."""
    return masked(torch.gather(x, 2, index[:, None, :].expand(-1, x.shape[1], -1)), rows)
