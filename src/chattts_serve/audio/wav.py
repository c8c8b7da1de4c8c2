"""WAV files (16-bit PCM, mono) with the standard library."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np


def to_pcm16(audio: np.ndarray) -> bytes:
    """float [-1, 1] -> little-endian int16 bytes (clipped)."""
    pcm = np.clip(np.nan_to_num(np.asarray(audio, dtype=np.float32)), -1.0, 1.0)
    return (pcm * 32767.0).round().astype("<i2").tobytes()


def write_wav(path: str | Path, audio: np.ndarray, sample_rate: int) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(to_pcm16(audio))


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """16-bit mono WAV -> (float32 audio, sample rate)."""
    with wave.open(str(path), "rb") as w:
        if w.getsampwidth() != 2 or w.getnchannels() != 1:
            raise ValueError(f"{path}: expected 16-bit mono PCM")
        data = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
        return data.astype(np.float32) / 32767.0, w.getframerate()
