"""KokoroModel: whole utterances of different lengths in one forward, each row equal to itself alone.

The forward is the package's ``KModel.forward_with_tokens``, generalised from one utterance to a padded
batch: ALBERT with a key mask, packed LSTMs, convolutions fed zeros past each row's end, instance norms
over each row's own frames, the duration alignment per row (a gather, which is exact where the package
multiplies by a one-hot matrix), and one noise generator per utterance in the sine source.

A batch costs what its padded size costs. On a CPU thread that is no saving over running the rows one at
a time (measured on the full-size checkpoint, one busy thread: 8 x 40 phonemes batched 1.6x slower than
one by one, 8 mixed lengths 3.8x slower): the convolutions are already compute-bound and the padded
tensors stream more memory. Batching pays where the device is underused by one utterance (a GPU); on a
CPU, whoever composes batches should keep them small and of like lengths.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .albert import Albert
from .config import KokoroConfig
from .decoder import Decoder
from .layers import Lengths, masked
from .prosody import ProsodyPredictor, TextEncoder
from .rows import torch_threads

RowSpectrum = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""One unpadded row's ``kernels.RowGraph`` inputs -> its spectrum [1, n_fft + 2, L] (float32, torch): what a graph
mode attaches (``kernels.attach``). Defined here, the side that calls it, so ``kernels`` imports ``model`` and not
the other way round."""


@dataclass(frozen=True)
class Utterance:
    """One utterance: ``input_ids`` with the 0 boundary at both ends; ``style`` the voice pack's row for
    its phoneme count ([1, 256] or [256]); ``generator`` None draws from torch's global generator."""

    input_ids: Sequence[int]
    style: torch.Tensor
    speed: float = 1.0
    generator: torch.Generator | None = None


@dataclass(frozen=True)
class Synthesis:
    audio: torch.Tensor  # float32 [samples] at config.sample_rate, before any clipping
    durations: torch.Tensor  # int64 [len(input_ids)]: frames per input id
    f0: torch.Tensor  # float32 [2 * frames]: the predicted F0 curve (Hz)
    energy: torch.Tensor  # float32 [2 * frames]
    samples_per_frame: int


class KokoroModel(nn.Module):
    def __init__(self, config: KokoroConfig):
        super().__init__()
        self.config = config
        self.bert = Albert(config.plbert, config.n_token)
        self.bert_encoder = nn.Linear(config.plbert.hidden_size, config.hidden_dim)
        self.predictor = ProsodyPredictor(config.style_dim, config.hidden_dim, config.n_layer, config.max_dur)
        self.text_encoder = TextEncoder(config.hidden_dim, config.text_encoder_kernel_size, config.n_layer,
                                        config.n_token)
        self.decoder = Decoder(config.hidden_dim, config.style_dim, config.istftnet, config.decoder_dim,
                               config.asr_res_dim)
        self.graphs = None
        """The decoder's CUDA graphs per bucket (``graphs.KokoroGraphs``, on CUDA with ``--cuda-graphs``)."""

    text_threads: int | None = None
    """The torch threads the text side runs on (None: the caller's). ``rows.RowPool`` sets 1: a row's F0 must not
    depend on the thread count it happened to run with (a 1-ulp change of F0 moves the waveform by ~1e-1 through
    the sine phase, and the LSTMs' last bits do change with it), and one thread is what a pooled row has."""
    row_spectrum: RowSpectrum | None = None
    """The decoder after its source as a compiled graph for one unpadded row (``kernels.attach``: the OpenVINO modes);
    None: torch runs it."""

    @property
    def device(self) -> torch.device:
        return self.bert_encoder.weight.device

    @property
    def decoder_dtype(self) -> torch.dtype:
        """The dtype the decoder's convolutions compute in (``cast_decoder``)."""
        return self.decoder.encode.conv1.weight.dtype

    def compile_decoder(self) -> KokoroModel:
        """AdaIN and snake of the generator's blocks as one compiled pass each (``torch.compile``, inductor; the
        engine's ``--compile``): about 1.2x on the decoder (bf16, full size, one thread), no longer the
        reference's roundings (47.8 dB SNR against the eager bf16 path). Compiled once for any length (dynamic
        shapes, seconds at the first utterance); a padded (ragged) batch runs the eager path."""
        from .blocks import AdaINResBlock1, norm_snake

        fused = torch.compile(norm_snake, dynamic=True)
        for block in self.decoder.modules():
            if isinstance(block, AdaINResBlock1):
                block.fused = fused
        return self

    def cast_decoder(self, dtype: torch.dtype) -> KokoroModel:
        """Run the decoder's convolutions in ``dtype`` (bf16: ``--audio-dtype bf16``), everything else in fp32.

        Only the convolutions, where the time goes: each takes its input rounded to ``dtype`` and gives fp32 back,
        so the residual sums, the norms, the snakes, the sine source (which integrates F0 into a phase of ~1e5
        radians) and the spectra keep fp32, and so does everything before the decoder: durations, F0 and energy
        are the fp32 ones exactly. Measured on the full-size random checkpoint, one thread: 43 dB SNR against
        fp32 where a decoder wholly in bf16 (its residual stream rounded at every sum) gave 10 dB, for about 0.9x
        of that one's speed.
        """
        convs = [m for m in self.decoder.modules() if isinstance(m, (nn.Conv1d, nn.ConvTranspose1d))]
        for conv in convs:
            if conv.weight.dtype == dtype:
                continue
            first = conv.weight.dtype == torch.float32
            conv.to(dtype)
            if first:  # the casts around it, once
                conv.register_forward_pre_hook(_input_to_weight_dtype)
                conv.register_forward_hook(_output_to_fp32)
        return self

    @torch.inference_mode()
    def synthesize(self, utterances: Sequence[Utterance], prosody: str = "rows") -> list[Synthesis]:
        """Audio for every utterance, the decoder run once over the padded batch.

        ``prosody="rows"`` (the default) runs the text side (ALBERT, durations, F0 and energy: a few
        percent of the work) one utterance at a time, so each row's durations and curves are its batch-1
        values bit for bit. That matters because the sine source integrates F0 into a phase of ~1e4-1e5
        radians over an utterance: a 1-ulp change of F0 moves the waveform by ~1e-2. ``"batch"`` runs the
        text side as one padded forward too (key-masked attention, packed LSTMs): durations still match,
        F0 within ~1e-6 relative, and the waveform only within that phase drift. With ``graphs`` (CUDA graphs
        per bucket, ``graphs.KokoroGraphs``) the text side runs through them, as ``"batch"`` does.
        """
        if prosody not in ("rows", "batch"):
            raise ValueError(f"prosody must be 'rows' or 'batch', got {prosody!r}")
        if not utterances:
            return []
        for i, u in enumerate(utterances):
            self._check(i, u)
        if self.row_spectrum is not None:
            return [self._graph_row(u) for u in utterances]
        # With CUDA graphs the text side runs as one padded forward (``graphs.KokoroGraphs.text_side``).
        side = self.graphs.text_side(utterances) if self.graphs is not None else None
        with torch_threads(self.text_threads):
            if side is None and (prosody == "batch" or len(utterances) == 1):
                side = self._text_side(utterances)
            elif side is None:
                side = _stack_sides([self._text_side([u]) for u in utterances])
        generators = [u.generator for u in utterances]
        audio = self.graphs.decode(side, generators) if self.graphs is not None else None
        if audio is None:  # no graphs, or none for this batch's bucket (nothing drawn yet)
            audio = self.decoder(side.asr, side.f0, side.energy, side.decoder_style, side.frames, generators)
        spf = self.config.samples_per_frame
        return [
            Synthesis(audio=audio[row], durations=side.durations[row, : len(u.input_ids)].cpu(),
                      f0=side.f0[row, : 2 * f].cpu(), energy=side.energy[row, : 2 * f].cpu(),
                      samples_per_frame=spf)
            for row, (u, f) in enumerate(zip(utterances, side.frames.lengths.tolist(), strict=True))
        ]

    def _graph_row(self, u: Utterance) -> Synthesis:
        """One utterance through ``row_spectrum`` (``kernels.attach``): the text side and the source in torch, the
        decoder's convolutions in the graph, the inverse STFT in torch."""
        with torch_threads(self.text_threads):
            side = self._text_side([u])
        generator = self.decoder.generator
        at = side.frames.scaled(2)  # F0's rate, where the decode blocks leave the generator
        har = generator.harmonics(side.f0, at, [u.generator])
        spectra = self.row_spectrum(side.asr, side.f0, side.energy, side.decoder_style, har)
        [audio] = generator.waveforms(spectra, generator.spectrum_lengths(at))
        return Synthesis(audio=audio, durations=side.durations[0].cpu(), f0=side.f0[0].cpu(),
                         energy=side.energy[0].cpu(), samples_per_frame=self.config.samples_per_frame)

    def _text_side(self, utterances: Sequence[Utterance]) -> _TextSide:
        """Everything before the decoder, for a padded batch (one forward)."""
        device, sd = self.device, self.config.style_dim
        token_counts = torch.tensor([len(u.input_ids) for u in utterances], dtype=torch.long)
        tokens = Lengths(token_counts, int(token_counts.max()))
        ids = torch.zeros(len(utterances), tokens.total, dtype=torch.long)
        for row, u in enumerate(utterances):
            ids[row, : len(u.input_ids)] = torch.as_tensor(list(u.input_ids), dtype=torch.long)
        ids = ids.to(device)
        ref = torch.stack([u.style.reshape(-1) for u in utterances]).to(device=device, dtype=torch.float32)
        decoder_style, prosody_style = ref[:, :sd], ref[:, sd:]

        valid = tokens.mask(device, torch.bool)[:, 0, :] if tokens.ragged else None
        d_en = self.bert_encoder(self.bert(ids, valid)).transpose(-1, -2)
        d = self.predictor.text_encoder(d_en, prosody_style, tokens)
        durations = self.predictor.durations(d, tokens, [u.speed for u in utterances])

        frame_counts = durations.sum(dim=1).cpu()
        frames = Lengths(frame_counts, int(frame_counts.max()))
        index = _frame_to_token(durations, frames.total)
        en = _align(d.transpose(-1, -2), index, frames)
        f0, energy = self.predictor.curves(en, prosody_style, frames)
        asr = _align(self.text_encoder(ids, tokens), index, frames)
        return _TextSide(durations, frames, asr, f0, energy, decoder_style)

    def _check(self, i: int, u: Utterance) -> None:
        n, limit = len(u.input_ids), self.config.context_length
        if n < 3:
            raise ValueError(f"utterance {i}: input_ids needs at least one phoneme between the 0 boundaries")
        if n > limit:
            raise ValueError(f"utterance {i}: {n} input ids exceed the model's context of {limit}")
        if any(not 0 <= t < self.config.n_token for t in u.input_ids):
            raise ValueError(f"utterance {i}: input ids must lie in [0, {self.config.n_token})")
        if u.style.numel() != self.config.voice_dim:
            raise ValueError(f"utterance {i}: style must hold {self.config.voice_dim} values (one voice row), "
                             f"got shape {tuple(u.style.shape)}")
        if not u.speed > 0:
            raise ValueError(f"utterance {i}: speed must be positive, got {u.speed!r}")


def _input_to_weight_dtype(conv: nn.Module, args: tuple) -> tuple:
    return (args[0].to(conv.weight.dtype), *args[1:])


def _output_to_fp32(conv: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    return out.float()


@dataclass(frozen=True)
class _TextSide:
    durations: torch.Tensor  # int64 [B, T] (0 on padding)
    frames: Lengths
    asr: torch.Tensor  # [B, C, F]
    f0: torch.Tensor  # [B, 2F]
    energy: torch.Tensor  # [B, 2F]
    decoder_style: torch.Tensor  # [B, style_dim]


def _stack_sides(sides: list[_TextSide]) -> _TextSide:
    """Single-row text sides as one right-padded batch (padding zero, as the decoder expects)."""
    def pad(tensors: list[torch.Tensor]) -> torch.Tensor:
        out = tensors[0].new_zeros((len(tensors), *tensors[0].shape[1:-1], max(t.shape[-1] for t in tensors)))
        for row, t in enumerate(tensors):
            out[row, ..., : t.shape[-1]] = t[0]
        return out

    frame_counts = torch.cat([s.frames.lengths for s in sides])
    return _TextSide(
        durations=pad([s.durations for s in sides]),
        frames=Lengths(frame_counts, int(frame_counts.max())),
        asr=pad([s.asr for s in sides]),
        f0=pad([s.f0 for s in sides]),
        energy=pad([s.energy for s in sides]),
        decoder_style=torch.cat([s.decoder_style for s in sides]),
    )


def _frame_to_token(durations: torch.Tensor, total: int) -> torch.Tensor:
    """[B, total]: the token each frame belongs to (0 on padding frames, which are masked after)."""
    index = torch.zeros(durations.shape[0], total, dtype=torch.long, device=durations.device)
    for row in range(durations.shape[0]):
        per_row = torch.repeat_interleave(torch.arange(durations.shape[1], device=durations.device), durations[row])
        index[row, : per_row.shape[0]] = per_row
    return index


def _align(x: torch.Tensor, index: torch.Tensor, frames: Lengths) -> torch.Tensor:
    """Token-rate [B, C, T] -> frame-rate [B, C, F], each frame a copy of its token's vector."""
    out = torch.gather(x, 2, index[:, None, :].expand(-1, x.shape[1], -1))
    return masked(out, frames)
