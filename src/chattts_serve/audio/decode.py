"""GPT outputs -> 24 kHz audio: Decoder (hidden states) or DVAE (codes) to log-mel, then Vocos.

Each utterance is decoded on its own (no zero padding shared with longer neighbours, unlike the
reference's batched decode), so its audio does not depend on what else was in the batch. N steps give
``512 * N - 256`` samples.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..model.checkpoint import LoadedModel
from .stream import Window


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
def decode_windows(model: LoadedModel, windows: list[Window], dtype: str = "fp32") -> list[np.ndarray]:
    """Decode many streams' windows: windows of equal length run as one batch (no zero padding, which
    would change the samples at a window's true end). ``dtype`` "bf16": under bf16 autocast (the
    engine's ``audio_dtype``)."""
    bf16 = dtype == "bf16"
    device_type = model.decoder.coef.device.type
    out: list[np.ndarray | None] = [None] * len(windows)
    groups: dict[int, list[int]] = {}
    for i, w in enumerate(windows):
        groups.setdefault(w.num_steps, []).append(i)
    for idx in groups.values():
        h = torch.stack([windows[i].stream.hidden[windows[i].start : windows[i].end] for i in idx])
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
            wav = model.vocos(model.decoder(h.transpose(1, 2)))  # [G, 512 * steps - 256]
        wav = wav.float().cpu().numpy().astype(np.float32, copy=False)
        for j, i in enumerate(idx):
            out[i] = wav[j]
    return out  # type: ignore[return-value]
