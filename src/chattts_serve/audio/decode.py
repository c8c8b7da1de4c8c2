"""GPT outputs -> 24 kHz audio: Decoder (hidden states) or DVAE (codes) to log-mel, then Vocos.

Each utterance is decoded on its own (no zero padding shared with longer neighbours, unlike the
reference's batched decode), so its audio does not depend on what else was in the batch. N steps give
``512 * N - 256`` samples.

Memory: a batch of windows is split into sub-batches whose estimated activations
(``activation_bytes_per_step``) stay under ``AUDIO_BATCH_BYTES``, and a sub-batch that still runs out
of memory is retried in halves, down to one window, before any window is given up.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from ..model.checkpoint import LoadedModel
from ..model.config import N_FFT, ModelConfig
from .stream import Window

logger = logging.getLogger(__name__)

AUDIO_BATCH_BYTES = 1 << 30
"""Estimated activation bytes one Decoder + Vocos call may take (1 GiB): at full size ~21k window
steps (e.g. 45 ten-second windows, or 170 streaming windows of 122 steps). Unbounded, 256 windows of
10 s took ~6 GB at once. Inside ``distributed.memory.ACTIVATION_RESERVE`` of any replica of >= 8 GiB."""

_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def activation_bytes_per_step(cfg: ModelConfig) -> int:
    """Estimated peak activation bytes of Decoder + Vocos per GPT step of one window, in fp32 (bf16
    autocast keeps fp32 in places: not halved). A step is two mel frames; per frame the widest stage
    holds its input, the normalised copy and the 4x (Decoder) / intermediate (Vocos) projection before
    and after GELU, or in the iSTFT head ~6 buffers of ``N_FFT + 2`` (linear out, magnitude, phase,
    cos/sin, the complex spectrum). Full size: 2 x 6156 x 4 = ~48 KiB per step."""
    dec = cfg.decoder.stack.hidden
    voc = cfg.vocos
    per_frame = max(2 * dec + 2 * 4 * dec, 2 * voc.dim + 2 * voc.intermediate_dim, 6 * (N_FFT + 2))
    return 2 * per_frame * 4


def is_oom(exc: BaseException) -> bool:
    """A device out-of-memory error (torch's class, or a RuntimeError that says so)."""
    return isinstance(exc, _OOM) or (isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower())


@torch.inference_mode()
def hidden_to_mel(model: LoadedModel, hiddens: torch.Tensor) -> torch.Tensor:
    """hiddens [T, hidden] -> log-mel [100, 2T]."""
    x = hiddens.to(model.decoder.coef.device, torch.float32).t()[None]
    return model.decoder(x)[0]


@torch.inference_mode()
def codes_to_mel(model: LoadedModel, codes: torch.Tensor) -> torch.Tensor:
    """codes [T, 4] -> log-mel [100, 2T] through the DVAE."""
    x = codes.to(model.dvae.coef.device).t()[None]
    return model.dvae(x)[0]


@torch.inference_mode()
def mel_to_wav(model: LoadedModel, mel: torch.Tensor) -> torch.Tensor:
    """log-mel [100, F] -> waveform [256 * (F - 1)] fp32."""
    return model.vocos(mel[None].float())[0]


def decode(
    model: LoadedModel, hiddens: torch.Tensor | None, codes: torch.Tensor, use_decoder: bool = True
) -> np.ndarray:
    """One utterance to float32 audio; an empty utterance gives an empty array."""
    if codes.shape[0] == 0:
        return np.zeros(0, dtype=np.float32)
    mel = hidden_to_mel(model, hiddens) if use_decoder else codes_to_mel(model, codes)
    return mel_to_wav(model, mel).cpu().numpy().astype(np.float32, copy=False)


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX-512 BF16 or AMX): elsewhere oneDNN emulates it and
    a bf16 decode is slower than fp32. Probed from /proc/cpuinfo (Linux; False elsewhere)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


@torch.inference_mode()
def decode_windows(
    model: LoadedModel, windows: list[Window], dtype: str = "fp32", max_bytes: int | None = None
) -> list[np.ndarray | Exception]:
    """Decode many streams' windows: windows of equal length run as one batch (no zero padding, which
    would change the samples at a window's true end), split so a call's estimated activations stay
    under ``max_bytes`` (default ``AUDIO_BATCH_BYTES``). ``dtype`` "bf16": under bf16 autocast (the
    engine's ``audio_dtype``). An entry is the exception instead of audio when its window could not be
    decoded: alone after an out-of-memory error, or with its sub-batch after any other error."""
    bf16 = dtype == "bf16"
    limit = AUDIO_BATCH_BYTES if max_bytes is None else max_bytes
    per_step = activation_bytes_per_step(model.config)
    out: list[np.ndarray | Exception | None] = [None] * len(windows)
    groups: dict[int, list[int]] = {}
    for i, w in enumerate(windows):
        groups.setdefault(w.num_steps, []).append(i)
    for steps, idx in groups.items():
        size = max(1, limit // max(1, per_step * steps))
        for lo in range(0, len(idx), size):
            part = idx[lo : lo + size]
            h = torch.stack([windows[i].stream.hidden[windows[i].start : windows[i].end] for i in part])
            for i, wav in zip(part, _decode_halving(model, h, bf16), strict=True):
                out[i] = wav
    return out  # type: ignore[return-value]


def _decode_halving(model: LoadedModel, h: torch.Tensor, bf16: bool) -> list[np.ndarray | Exception]:
    """``_decode_batch``, retried in halves after an out-of-memory error (down to one window)."""
    try:
        return list(_decode_batch(model, h, bf16))
    except Exception as exc:
        if h.shape[0] == 1 or not is_oom(exc):
            return [exc] * h.shape[0]
    # Outside the handler: the failed attempt's tensors (held by its traceback) are freed by now.
    if h.is_cuda:
        torch.cuda.empty_cache()
    mid = h.shape[0] // 2
    logger.warning(
        "audio decode of %d windows ran out of memory; retrying as %d + %d", h.shape[0], mid, h.shape[0] - mid
    )
    return _decode_halving(model, h[:mid], bf16) + _decode_halving(model, h[mid:], bf16)


def _decode_batch(model: LoadedModel, h: torch.Tensor, bf16: bool) -> np.ndarray:
    """Hidden states ``[G, steps, hidden]`` -> audio ``[G, 512 * steps - 256]`` float32 on the host."""
    with torch.autocast(model.decoder.coef.device.type, dtype=torch.bfloat16, enabled=bf16):
        wav = model.vocos(model.decoder(h.transpose(1, 2)))
    return wav.float().cpu().numpy().astype(np.float32, copy=False)
