"""VitsModel: whole utterances in, waveforms and durations out; one forward for a batch of mixed lengths.

Per utterance, the steps and the noise are transformers' ``VitsModel`` at batch 1:

1. text encoder -> hidden states and the prior's per-token means / log-variances;
2. duration predictor: log-durations from noise ``randn(1, 2, L) * noise_scale_duration`` (the stochastic
   predictor's reverse flow); durations = ceil(exp(log_d) / speaking_rate) frames per token;
3. the prior expanded by the durations, plus noise ``randn_like(means) * exp(log_var) * noise_scale``;
4. the flow in reverse -> the latent; 5. the HiFi-GAN decoder -> the waveform (tanh: within [-1, 1]).

Batch invariance: each utterance carries its own ``torch.Generator`` and draws its two noise tensors from it
in the shapes and order transformers draws them at batch 1 (so a generator seeded with s reproduces
``torch.manual_seed(s)`` before transformers' forward). Steps 1-3 run row by row (the text side is cheap and,
alone, a row's durations are bit-exact); steps 4-5, where the time goes, run on padded groups of rows of
similar length (``decode_groups``; row by row on the CPU, where a batch buys nothing) with every convolution
masked. A row's durations are therefore exact whatever its batch, and its waveform equals itself alone within
float rounding of the batched convolutions (measured in tests/models/vits/test_model.py).

Noise is drawn on the CPU (then moved), so a seed gives the same noise on every device.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .config import VitsConfig
from .decoder import HifiGan
from .duration import DurationPredictor, StochasticDurationPredictor
from .flow import PosteriorEncoder, ResidualCouplingBlock
from .masks import Lengths
from .text_encoder import TextEncoder


@dataclass(frozen=True)
class Utterance:
    """One utterance: token ids (``VitsTokenizer`` output, blanks included) and its sampling options; None
    takes the checkpoint's config value. ``generator`` None draws from a fresh unseeded generator."""

    input_ids: Sequence[int]
    speaking_rate: float | None = None
    noise_scale: float | None = None
    noise_scale_duration: float | None = None
    generator: torch.Generator | None = None
    speaker_id: int | None = None
    speaker_mix: Sequence[tuple[int, float]] | None = None
    """Instead of ``speaker_id`` (multi-speaker checkpoints): speaker ids and weights (summing to 1); the row is
    conditioned on the weighted mean of their embeddings (a blend of voices)."""


@dataclass(frozen=True)
class Latent:
    """An utterance after the text side: what the flow and the decoder need, and its durations."""

    durations: torch.Tensor  # int64 [L], frames per input id
    prior: torch.Tensor  # [flow_size, T] prior sample (noise added), T = max(1, sum(durations))
    speaker: torch.Tensor | None  # [speaker_embedding_size, 1] or None


@dataclass(frozen=True)
class Synthesis:
    audio: torch.Tensor  # float32 [T * samples_per_frame], on the CPU
    durations: torch.Tensor  # int64 [L] frames per input id (sum = T, or T = 1 when all are 0)
    samples_per_frame: int


class VitsModel(nn.Module):
    def __init__(self, config: VitsConfig):
        super().__init__()
        self.config = config
        self.text_encoder = TextEncoder(config)
        self.flow = ResidualCouplingBlock(config)
        self.decoder = HifiGan(config)
        if config.use_stochastic_duration_prediction:
            self.duration_predictor: nn.Module = StochasticDurationPredictor(config)
        else:
            self.duration_predictor = DurationPredictor(config)
        if config.num_speakers > 1:
            self.embed_speaker = nn.Embedding(config.num_speakers, config.speaker_embedding_size)
        self.posterior_encoder: PosteriorEncoder | None = PosteriorEncoder(config)
        self.batch_decoder: bool | None = None
        """Run the flow and decoder on padded groups of rows (None: on accelerators, not on the CPU)."""
        self.max_padding = 0.25
        """A group's padded frames may exceed its rows' own frames by at most this fraction."""
        self.row_decoder = None
        """A faster kernel for the flow and decoder of one unpadded row (``kernels.attach``: the CPU precision
        modes); None: eager torch."""
        self.graphs = None
        """The flow and decoder as CUDA graphs per bucket (``graphs.VitsGraphs``, on CUDA with ``--cuda-graphs``)."""

    def drop_training_modules(self) -> None:
        """Free the posterior encoder (training only; built so the load can check its weights)."""
        self.posterior_encoder = None

    @property
    def device(self) -> torch.device:
        return self.text_encoder.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.text_encoder.embed_tokens.weight.dtype

    @property
    def decode_dtype(self) -> torch.dtype:
        """The flow and decoder's dtype (bf16 in that mode on an accelerator; the text side stays in ``dtype``)."""
        return self.decoder.conv_pre.weight.dtype

    @torch.inference_mode()
    def synthesize(self, batch: Sequence[Utterance]) -> list[Synthesis]:
        """One forward for ``batch``; each row's result does not depend on the others."""
        if not batch:
            return []
        latents = [self.latent(u) for u in batch]
        waveforms = self.decode_latents(latents)
        hop = self.config.samples_per_frame
        return [Synthesis(w, lat.durations, hop) for w, lat in zip(waveforms, latents, strict=True)]

    @torch.inference_mode()
    def latent(self, utt: Utterance) -> Latent:
        """Steps 1-3 for one utterance (see the module docstring)."""
        c = self.config
        ids = self._check_ids(utt.input_ids)
        rate = c.speaking_rate if utt.speaking_rate is None else float(utt.speaking_rate)
        noise_scale = c.noise_scale if utt.noise_scale is None else float(utt.noise_scale)
        noise_scale_duration = c.noise_scale_duration if utt.noise_scale_duration is None \
            else float(utt.noise_scale_duration)
        if not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"speaking_rate must be a positive number, got {rate!r}")
        for name, value in (("noise_scale", noise_scale), ("noise_scale_duration", noise_scale_duration)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a non-negative number, got {value!r}")
        generator = utt.generator if utt.generator is not None else torch.Generator()
        speaker = self._speaker(utt.speaker_id) if utt.speaker_mix is None else self._mixed_speaker(utt.speaker_mix)
        device, dtype = self.device, self.dtype

        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        hidden, means, log_variances = self.text_encoder(input_ids)
        hidden = hidden.transpose(1, 2)
        length = len(ids)
        if isinstance(self.duration_predictor, StochasticDurationPredictor):
            noise = torch.randn(1, 2, length, generator=generator).to(device=device, dtype=dtype) \
                * noise_scale_duration
            log_duration = self.duration_predictor(hidden, noise, speaker)
        else:
            log_duration = self.duration_predictor(hidden, speaker)
        durations = torch.ceil(torch.exp(log_duration) * (1.0 / rate))[0, 0].long()  # as transformers rounds
        total = max(1, int(durations.sum()))
        # The expansion transformers does with a one-hot matmul: each frame takes its token's row exactly.
        index = torch.repeat_interleave(torch.arange(length, device=device), durations)
        frames = torch.zeros(1, total, c.flow_size, device=device, dtype=dtype)
        var_frames = torch.zeros(1, total, c.flow_size, device=device, dtype=dtype)
        frames[0, : index.numel()] = means[0, index]
        var_frames[0, : index.numel()] = log_variances[0, index]
        prior_means, prior_log_variances = frames.transpose(1, 2), var_frames.transpose(1, 2)
        # transformers draws randn_like(means) on the transposed (non-contiguous) means: torch fills such a
        # tensor element by element in memory order, which differs from randn(1, flow, T); same strides here.
        noise = torch.empty(1, total, c.flow_size).transpose(1, 2).normal_(generator=generator)
        noise = noise.to(device=device, dtype=dtype)
        prior = prior_means + noise * torch.exp(prior_log_variances) * noise_scale
        return Latent(durations.cpu(), prior[0], None if speaker is None else speaker[0])

    @torch.inference_mode()
    def decode_latents(self, latents: Sequence[Latent]) -> list[torch.Tensor]:
        """Steps 4-5: the flow in reverse, then the decoder; one waveform per row (on the CPU).

        Rows run together in groups of similar length (``decode_groups``): on the CPU one row at a time (one
        thread gains nothing from a batch: 4 rows of one length took 14 % longer together than one by one, and
        padding only adds work), elsewhere padded groups whose padding stays under ``max_padding`` of the work.
        """
        out: list[torch.Tensor | None] = [None] * len(latents)
        for group in decode_groups([lat.prior.shape[-1] for lat in latents], self._together(), self.max_padding):
            for row, audio in zip(group, self._decode_padded([latents[i] for i in group]), strict=True):
                out[row] = audio
        return out  # type: ignore[return-value]

    def _together(self) -> bool:
        from ...engine.batch import pads_rows

        return pads_rows(self.device) if self.batch_decoder is None else self.batch_decoder

    def _decode_padded(self, latents: Sequence[Latent]) -> list[torch.Tensor]:
        if self.row_decoder is not None and len(latents) == 1:
            lat = latents[0]
            return [self.row_decoder(lat.prior[None], None if lat.speaker is None else lat.speaker[None])]
        if self.graphs is not None:
            audio = self.graphs.decode(latents, self._batch_speaker(latents))
            if audio is not None:
                return audio
        lengths = Lengths([lat.prior.shape[-1] for lat in latents])
        dtype = self.decode_dtype
        prior = torch.zeros(len(latents), self.config.flow_size, lengths.total, device=self.device, dtype=dtype)
        for row, lat in enumerate(latents):
            prior[row, :, : lat.prior.shape[-1]] = lat.prior
        speaker = self._batch_speaker(latents)
        speaker = None if speaker is None else speaker.to(dtype)
        mask = lengths.mask(self.device, dtype)
        latent = self.flow.reverse(prior, mask, speaker) * mask
        audio = self.decoder(latent, lengths, speaker)
        hop = self.config.samples_per_frame
        return [audio[row, : n * hop].float().cpu() for row, n in enumerate(lengths.lengths)]

    def stream(self, utt: Utterance, chunk_frames: int = 32) -> tuple[torch.Tensor, Iterator[torch.Tensor]]:
        """One utterance's durations now, and its audio as an iterator of pieces of ``chunk_frames`` latent
        frames (``chunk_frames * samples_per_frame`` samples, the last shorter), each decoded when asked for.
        Joined, the pieces equal ``synthesize([utt])``'s audio within float rounding (the decoder sees each
        piece's receptive field; see ``decoder.decode_range``)."""
        lat = self.latent(utt)
        latent = self.flow_latent(lat)
        speaker = None if lat.speaker is None else lat.speaker[None].to(self.decode_dtype)

        def pieces() -> Iterator[torch.Tensor]:
            with torch.inference_mode():
                for piece in self.decoder.decode_chunks(latent, chunk_frames, speaker):
                    yield piece.float().cpu()

        return lat.durations, pieces()

    @torch.inference_mode()
    def flow_latent(self, lat: Latent) -> torch.Tensor:
        """One row's decoder input [1, flow_size, T] (for streaming with ``decoder.decode_chunks``)."""
        prior = lat.prior[None].to(self.device, self.decode_dtype)
        mask = torch.ones(1, 1, prior.shape[-1], device=self.device, dtype=self.decode_dtype)
        speaker = None if lat.speaker is None else lat.speaker[None].to(self.decode_dtype)
        return self.flow.reverse(prior, mask, speaker) * mask

    def _check_ids(self, input_ids: Sequence[int]) -> list[int]:
        ids = [int(i) for i in input_ids]
        if not ids:
            raise ValueError("input_ids is empty (the text has no character in the checkpoint's vocabulary)")
        bad = [i for i in ids if not 0 <= i < self.config.vocab_size]
        if bad:
            raise ValueError(f"input_ids holds {bad[0]}, outside the vocabulary [0, {self.config.vocab_size})")
        return ids

    def _speaker(self, speaker_id: int | None) -> torch.Tensor | None:
        """[1, speaker_embedding_size, 1] for a multi-speaker checkpoint given an id, else None (as transformers,
        which runs a multi-speaker model unconditioned when no id is given)."""
        if speaker_id is None or self.config.num_speakers <= 1:
            if speaker_id not in (None, 0):
                raise ValueError(f"speaker_id {speaker_id} given, but this checkpoint has one speaker")
            return None
        if not 0 <= speaker_id < self.config.num_speakers:
            raise ValueError(f"speaker_id must be in [0, {self.config.num_speakers - 1}], got {speaker_id}")
        index = torch.tensor([speaker_id], device=self.device)
        return self.embed_speaker(index).unsqueeze(-1)

    def _mixed_speaker(self, mix: Sequence[tuple[int, float]]) -> torch.Tensor:
        """[1, speaker_embedding_size, 1]: the weighted mean of the speakers' embeddings."""
        ids = [int(i) for i, _ in mix]
        if self.config.num_speakers <= 1 or not ids:
            raise ValueError("speaker_mix needs a multi-speaker checkpoint and at least one speaker")
        if not all(0 <= i < self.config.num_speakers for i in ids):
            raise ValueError(f"speaker_mix ids must be in [0, {self.config.num_speakers - 1}], got {ids}")
        weights = torch.tensor([float(w) for _, w in mix], device=self.device, dtype=self.dtype)
        embeddings = self.embed_speaker(torch.tensor(ids, device=self.device))
        return (weights[:, None] * embeddings).sum(0)[None, :, None]

    def _batch_speaker(self, latents: Sequence[Latent]) -> torch.Tensor | None:
        given = [lat.speaker is not None for lat in latents]
        if not any(given):
            return None
        if not all(given):
            # Rows with and without a speaker cannot share the conditioned convolutions.
            raise ValueError("a batch mixes utterances with and without speaker_id; give every row one or none")
        return torch.stack([lat.speaker for lat in latents])


def decode_groups(lengths: Sequence[int], together: bool, max_padding: float) -> list[list[int]]:
    """Row indices grouped for the padded decoder: longest first, a row joining the current group while the
    group's padded size (rows x its longest) stays within (1 + max_padding) x the sum of its lengths."""
    if not together:
        return [[i] for i in range(len(lengths))]
    groups: list[list[int]] = []
    work = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= (1 + max_padding) * (work + lengths[i]):
            groups[-1].append(i)
            work += lengths[i]
        else:
            groups.append([i])
            work = lengths[i]
    return groups


def as_numpy(audio: torch.Tensor) -> np.ndarray:
    return audio.detach().to(torch.float32).cpu().numpy()
