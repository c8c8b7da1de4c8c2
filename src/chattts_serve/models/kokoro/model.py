"""KokoroModel: whole utterances of different lengths in one forward, each row equal to itself alone.

The forward is the package's ``KModel.forward_with_tokens``, generalised from one utterance to a padded
batch: ALBERT with a key mask, packed LSTMs, convolutions fed zeros past each row's end, instance norms
over each row's own frames, the duration alignment per row (a gather, which is exact where the package
multiplies by a one-hot matrix), and one noise generator per utterance in the sine source.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .albert import Albert
from .config import KokoroConfig
from .decoder import Decoder
from .layers import Lengths, masked
from .prosody import ProsodyPredictor, TextEncoder


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
        self.decoder = Decoder(config.hidden_dim, config.style_dim, config.istftnet)

    @property
    def device(self) -> torch.device:
        return self.bert_encoder.weight.device

    @torch.inference_mode()
    def synthesize(self, utterances: Sequence[Utterance]) -> list[Synthesis]:
        if not utterances:
            return []
        for i, u in enumerate(utterances):
            self._check(i, u)
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
        audio = self.decoder(asr, f0, energy, decoder_style, frames, [u.generator for u in utterances])

        spf = self.config.samples_per_frame
        return [
            Synthesis(audio=audio[row], durations=durations[row, :n].cpu(), f0=f0[row, : 2 * f].cpu(),
                      energy=energy[row, : 2 * f].cpu(), samples_per_frame=spf)
            for row, (n, f) in enumerate(zip(token_counts.tolist(), frame_counts.tolist(), strict=True))
        ]

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
