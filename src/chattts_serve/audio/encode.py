"""Streaming audio encoders: one per response, so a streamed body is one valid file/stream.

``StreamingEncoder(fmt).write(pcm)`` returns the bytes ready so far; ``finish()`` flushes the encoder
and the container. mp3 (MPEG audio frames), opus (Ogg pages), aac (ADTS frames) and flac go through
PyAV; wav and pcm (s16le) are written directly. A streamed wav has an open-ended header (sizes
0xFFFFFFFF, which ffmpeg, browsers and most players read as "until the end"); ``encode_whole`` writes
exact sizes when the whole audio is known.
"""

from __future__ import annotations

import struct

import numpy as np

from ..model.config import SAMPLE_RATE
from .wav import to_pcm16

FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
# container, codec, muxer options (small Ogg pages so opus leaves as it is encoded)
_AV = {
    "mp3": ("mp3", "libmp3lame", {}),
    "opus": ("ogg", "libopus", {"page_duration": "100000"}),
    "aac": ("adts", "aac", {}),
    "flac": ("flac", "flac", {}),
}
_NEEDS_A_FRAME = ("mp3", "opus", "aac")
"""Formats whose decoders cannot open a stream without a single frame (PyAV refuses an empty Ogg Opus, MP3 or
ADTS stream): with no audio at all they carry the shortest silence their codec makes. An empty flac or wav
(a header, no samples) opens as it is."""


def wav_header(num_samples: int | None, sample_rate: int = SAMPLE_RATE) -> bytes:
    """44-byte PCM16 mono header; ``None`` = unknown length (streaming)."""
    data = 0xFFFFFFFF if num_samples is None else 2 * num_samples
    riff = 0xFFFFFFFF if num_samples is None else 36 + data
    return (
        b"RIFF"
        + struct.pack("<I", riff)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, 2 * sample_rate, 2, 16)
        + b"data"
        + struct.pack("<I", data)
    )


class _Sink:
    """A write-only file object PyAV writes into; we hand its bytes out as they appear."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def write(self, data) -> int:
        self._buf += data
        return len(data)

    def seekable(self) -> bool:
        return False

    def flush(self) -> None:
        pass

    def drain(self) -> bytes:
        out = bytes(self._buf)
        self._buf.clear()
        return out


class StreamingEncoder:
    def __init__(self, fmt: str, sample_rate: int = SAMPLE_RATE) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unsupported format {fmt!r}; choose one of {', '.join(FORMATS)}")
        self.fmt, self.sample_rate = fmt, sample_rate
        self._started = False
        self._closed = False
        self._pts = 0
        if fmt in _AV:
            import av

            container, codec, options = _AV[fmt]
            self._sink = _Sink()
            self._container = av.open(self._sink, mode="w", format=container, options=options)
            self._stream = self._container.add_stream(codec, rate=sample_rate, layout="mono")
            if fmt == "mp3":
                self._stream.bit_rate = 64_000
            elif fmt in ("opus", "aac"):
                self._stream.bit_rate = 48_000

    def write(self, pcm: np.ndarray) -> bytes:
        """Encode float32 PCM in [-1, 1]; returns the bytes ready so far (maybe none)."""
        if self._closed:
            raise RuntimeError("encoder already finished")
        if self.fmt == "pcm":
            return to_pcm16(pcm)
        if self.fmt == "wav":
            head = b"" if self._started else wav_header(None, self.sample_rate)
            self._started = True
            return head + to_pcm16(pcm)
        if len(pcm) == 0:
            return self._sink.drain()
        import av

        samples = np.frombuffer(to_pcm16(pcm), dtype="<i2")[None, :]
        frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
        frame.sample_rate = self.sample_rate
        frame.pts = self._pts
        self._pts += samples.shape[1]
        for packet in self._stream.encode(frame):
            self._container.mux(packet)
        return self._sink.drain()

    def finish(self) -> bytes:
        """Flush everything; the bytes returned complete the stream."""
        if self._closed:
            return b""
        head = b""
        if self._pts == 0 and self.fmt in _NEEDS_A_FRAME:  # no audio at all: still a file its decoder opens
            head = self.write(np.zeros(1, np.float32))
        self._closed = True
        if self.fmt == "pcm":
            return b""
        if self.fmt == "wav":
            return b"" if self._started else wav_header(None, self.sample_rate)
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
        return head + self._sink.drain()

    def close(self) -> None:
        """Release resources without producing output (e.g. the client went away)."""
        if not self._closed and self.fmt in _AV:
            self._closed = True
            try:
                self._container.close()
            except Exception:  # noqa: BLE001 - best effort on an abandoned stream
                pass


def encode_whole(audio: np.ndarray, fmt: str, sample_rate: int = SAMPLE_RATE) -> bytes:
    """A complete file (wav with exact sizes)."""
    if fmt == "wav":
        return wav_header(len(audio), sample_rate) + to_pcm16(audio)
    enc = StreamingEncoder(fmt, sample_rate)
    return enc.write(audio) + enc.finish()
