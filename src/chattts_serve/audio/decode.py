"""GPT outputs -> 24 kHz audio: Decoder (hidden states) or DVAE (codes) to log-mel, then Vocos.

Each utterance is decoded as if alone (unlike the reference's batched decode, whose zero padding
shared with longer neighbours changes a short utterance's end), so its audio does not depend on what
else was in the batch. N steps give ``512 * N - 256`` samples. Windows of equal length share a call;
on CUDA (``buckets``) windows are padded up to a few fixed lengths so the kernels see repeating
shapes, with the padding masked out so that it changes nothing but float rounding.

Memory: a batch of windows is split into sub-batches whose estimated activations
(``activation_bytes_per_step``) stay under ``AUDIO_BATCH_BYTES``, and a sub-batch that still runs out
of memory is retried in halves, down to one window, before any window is given up.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..device import pinned_copy
from ..models.chattts.checkpoint import LoadedModel
from ..models.chattts.config import N_FFT, SAMPLES_PER_TOKEN, ModelConfig
from ..tf32 import fp32_scope, tf32_scope
from .stream import Window

logger = logging.getLogger(__name__)

AUDIO_BATCH_BYTES = 1 << 30
"""Estimated activation bytes one Decoder + Vocos call may take (1 GiB): at full size ~21k window
steps (e.g. 45 ten-second windows, or 170 streaming windows of 122 steps). Unbounded, 256 windows of
10 s took ~6 GB at once. Inside ``distributed.memory.ACTIVATION_RESERVE`` of any replica of >= 8 GiB."""

_DTYPES = ("fp32", "tf32", "bf16")

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


@torch.inference_mode()
def decode_windows(
    model: LoadedModel,
    windows: list[Window],
    dtype: str = "fp32",
    max_bytes: int | None = None,
    buckets: bool = False,
) -> list[np.ndarray | Exception]:
    """Decode many streams' windows to host audio, synchronously (``decode_on_device``, then each
    window's samples on the host). An entry is the exception instead of audio when its window could
    not be decoded: alone after an out-of-memory error, or with its sub-batch after any other error."""
    out: list[np.ndarray | Exception | None] = [None] * len(windows)
    for batch in decode_on_device(model, windows, dtype, max_bytes, buckets):
        if batch.error is not None:
            for i in batch.index:
                out[i] = batch.error
            continue
        wav = batch.wav.float().cpu().numpy()
        for row, (i, n) in enumerate(zip(batch.index, batch.samples, strict=True)):
            out[i] = wav[row, :n]
    return out  # type: ignore[return-value]


@dataclass(slots=True)
class DecodedBatch:
    """One Decoder + Vocos call's output: windows ``index`` (positions in the caller's list), each
    with its true ``samples``; ``wav`` [G, >= max(samples)] fp32 on the device, or the ``error``."""

    index: list[int]
    samples: list[int]
    wav: torch.Tensor | None = None
    error: Exception | None = None


def window_bucket(steps: int) -> int:
    """Steps a window is padded to when bucketed: a multiple of 8 up to 64, then 8 sizes per octave
    (at most 1/8 padding; 56 shapes up to 4096 steps), so the kernels see a few shapes again and again."""
    if steps < 1:
        raise ValueError(f"a window has at least one step, got {steps}")
    if steps <= 64:
        return -(-steps // 8) * 8
    q = 1 << (steps.bit_length() - 4)
    return -(-steps // q) * q


def plan_batches(steps: list[int], per_step: int, max_bytes: int, buckets: bool) -> list[tuple[int, list[int]]]:
    """(steps of the call, window indices) for each Decoder + Vocos call: windows of one length (or
    one bucket), split so a call's estimated activations ``per_step * steps * windows`` stay under
    ``max_bytes`` (at least one window a call)."""
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(steps):
        groups.setdefault(window_bucket(n) if buckets else n, []).append(i)
    plan = []
    for length, idx in groups.items():
        size = max(1, max_bytes // max(1, per_step * length))
        plan += [(length, idx[lo : lo + size]) for lo in range(0, len(idx), size)]
    return plan


def decode_on_device(
    model: LoadedModel,
    windows: list[Window],
    dtype: str = "fp32",
    max_bytes: int | None = None,
    buckets: bool = False,
) -> list[DecodedBatch]:
    """Decoder + Vocos on every window, the audio left on the device (nothing here waits for it).

    Windows of equal length run as one batch; ``buckets``: windows of one ``window_bucket`` do,
    right-padded to it, with every convolution seeing zeros past a row's end (``_padding_masked``)
    and the iSTFT normalising each row by its own frames, so a row's samples are those of its window
    decoded alone (to float rounding: the matmuls see other row counts). ``dtype``: "fp32", "tf32"
    (TF32 matmuls on CUDA; fp32 elsewhere) or "bf16" (autocast). Batches are bounded by
    ``max_bytes`` (default ``AUDIO_BATCH_BYTES``) and retried in halves after an out-of-memory error."""
    if dtype not in _DTYPES:
        raise ValueError(f"audio dtype must be one of {', '.join(_DTYPES)}; got {dtype!r}")
    limit = AUDIO_BATCH_BYTES if max_bytes is None else max_bytes
    steps = [w.num_steps for w in windows]
    out = []
    for length, part in plan_batches(steps, activation_bytes_per_step(model.config), limit, buckets):
        h = _stack(windows, part, length)
        true_steps = [steps[i] for i in part] if buckets else None
        for lo, hi, result in _decode_halving(model, h, dtype, true_steps, 0):
            idx = part[lo:hi]
            samples = [SAMPLES_PER_TOKEN * steps[i] - SAMPLES_PER_TOKEN // 2 for i in idx]
            if isinstance(result, Exception):
                out.append(DecodedBatch(idx, samples, error=result))
            else:
                out.append(DecodedBatch(idx, samples, wav=result))
    return out


def _stack(windows: list[Window], part: list[int], length: int) -> torch.Tensor:
    """The hidden states of windows ``part``, right-padded with zeros to ``length`` steps: one copy
    kernel (a cat of views), not one per window."""
    views = [windows[i].stream.hidden[windows[i].start : windows[i].end] for i in part]
    if all(v.shape[0] == length for v in views):
        return torch.stack(views)
    zeros = views[0].new_zeros(length, views[0].shape[1])
    pieces = []
    for v in views:
        pieces += [v, zeros[: length - v.shape[0]]]
    return torch.cat(pieces).view(len(views), length, -1)


def _decode_halving(
    model: LoadedModel, h: torch.Tensor, dtype: str, steps: list[int] | None, offset: int
) -> list[tuple[int, int, torch.Tensor | Exception]]:
    """``_decode_batch`` as (first row, end row, wav or error) pieces, retried in halves after an
    out-of-memory error (down to one window)."""
    try:
        return [(offset, offset + h.shape[0], _decode_batch(model, h, dtype, steps))]
    except Exception as exc:
        if h.shape[0] == 1 or not is_oom(exc):
            return [(offset, offset + h.shape[0], exc)]
    # Outside the handler: the failed attempt's tensors (held by its traceback) are freed by now.
    if h.is_cuda:
        torch.cuda.empty_cache()
    mid = h.shape[0] // 2
    logger.warning(
        "audio decode of %d windows ran out of memory; retrying as %d + %d", h.shape[0], mid, h.shape[0] - mid
    )
    first = _decode_halving(model, h[:mid], dtype, None if steps is None else steps[:mid], offset)
    return first + _decode_halving(model, h[mid:], dtype, None if steps is None else steps[mid:], offset + mid)


def _decode_batch(model: LoadedModel, h: torch.Tensor, dtype: str, steps: list[int] | None) -> torch.Tensor:
    """Hidden states ``[G, S, hidden]`` -> audio ``[G, 512 * S - 256]`` fp32 on the device. ``steps``:
    each row's true length when rows are right-padded (None: all are ``S`` long)."""
    device = h.device
    with _precision(dtype, device.type):
        if steps is None:
            wav = model.vocos(model.decoder(h.transpose(1, 2)))
        else:
            frames = _to_device(torch.tensor(steps, dtype=torch.long) * 2, device)
            drop = torch.arange(2 * h.shape[1], device=device)[None, None] >= frames[:, None, None]
            with _padding_masked((model.decoder, model.vocos), drop):
                wav = model.vocos(model.decoder(h.transpose(1, 2)), frames)
    return wav.float()


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device without a sync: through pinned memory on CUDA (torch keeps the pinned block
    until the copy is done)."""
    return pinned_copy(t, device)


@contextmanager
def _padding_masked(modules: tuple[nn.Module, ...], drop: torch.Tensor) -> Iterator[None]:
    """While active, every convolution wider than one frame in ``modules`` sees zeros where ``drop``
    [G, 1, frames] is true: what a row's own zero padding gives it when decoded alone. Every other
    layer (LayerNorm, the pointwise MLPs, the 1x1 convolutions) works per frame, so the padding frames
    cannot reach a row's own frames except through these. (Hooks rather than a mask argument, so the
    Decoder and Vocos modules stay the reference's.)"""

    def mask(module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        if x.shape[-1] != drop.shape[-1]:
            raise RuntimeError(f"{module}: {x.shape[-1]} frames, mask of {drop.shape[-1]}")
        return (x.masked_fill(drop, 0.0), *args[1:])

    handles = []
    try:
        for root in modules:
            for m in root.modules():
                if isinstance(m, nn.Conv1d) and m.kernel_size[0] > 1:
                    if m.stride[0] != 1:
                        raise RuntimeError(f"{m}: a strided convolution cannot be padded per frame")
                    handles.append(m.register_forward_pre_hook(mask))
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _precision(dtype: str, device_type: str) -> Iterator[None]:
    """bf16: autocast. On CUDA, tf32: TF32 matmuls and convolutions for the launches of this decode;
    fp32: strict IEEE fp32, convolutions included (cuDNN's default is TF32). Both scoped (``tf32``)."""
    if dtype == "bf16":
        with torch.autocast(device_type, dtype=torch.bfloat16):
            yield
        return
    if device_type != "cuda":
        yield
        return
    with tf32_scope() if dtype == "tf32" else fp32_scope():
        yield
