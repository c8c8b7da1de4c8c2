"""Streaming audio encoders: one per response, so a streamed body is one valid file/stream.

``StreamingEncoder(fmt).write(pcm)`` returns the bytes ready so far; ``finish()`` flushes the encoder
and the container. mp3 (MPEG audio frames), opus (Ogg pages), aac (ADTS frames) and flac go through
PyAV; wav and pcm (s16le) are written directly. A streamed wav has an open-ended header (sizes
0xFFFFFFFF, which ffmpeg, browsers and most players read as "until the end"); ``encode_whole`` writes
exact sizes when the whole audio is known.

mulaw and alaw are G.711 (ITU-T): one byte per sample, headerless, 8 kHz by default, what Twilio media
streams and SIP gateways carry; PyAV's ``pcm_mulaw`` / ``pcm_alaw`` encoders make them. pcm, wav, flac,
mulaw and alaw can be had at any ``sample_rate`` in 8000-48000 (``audio.resample``, one resampler per
stream). mp3, opus and aac stay at the model's rate (``check_rate``; ChatTTS's 24 kHz): their decoders resample as they
play, so another rate would only change what the codec spends its bits on.
"""

from __future__ import annotations

import struct

import numpy as np

from .resample import MAX_RATE, MIN_RATE, StreamingResampler, resample
from .wav import to_pcm16

FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm", "mulaw", "alaw")
RESAMPLED = ("pcm", "wav", "flac", "mulaw", "alaw")
"""The formats that take a ``sample_rate``; the others are encoded at the model's rate."""
_G711 = {"mulaw": "pcm_mulaw", "alaw": "pcm_alaw"}
TELEPHONY_RATE = 8000
"""G.711's rate (narrowband telephony): mulaw's and alaw's default."""
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


def wav_header(num_samples: int | None, sample_rate: int) -> bytes:
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


def default_rate(fmt: str, model_rate: int) -> int:
    """The output rate of ``fmt`` when the request names none (``model_rate``: the model's)."""
    return TELEPHONY_RATE if fmt in _G711 else model_rate


def check_rate(fmt: str, sample_rate: int | None, model_rate: int) -> int:
    """The output rate of ``fmt`` at ``sample_rate`` (None: its default) from audio at ``model_rate``; ValueError
    when it cannot be had."""
    if fmt not in FORMATS:
        raise ValueError(f"unsupported format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if sample_rate is None:
        return default_rate(fmt, model_rate)
    if not MIN_RATE <= sample_rate <= MAX_RATE:
        raise ValueError(f"sample_rate must be between {MIN_RATE} and {MAX_RATE}, got {sample_rate}")
    if fmt not in RESAMPLED and sample_rate != model_rate:
        raise ValueError(
            f"sample_rate applies to {', '.join(RESAMPLED)}; {fmt} is always encoded at {model_rate} Hz"
            " (its decoder plays it at the device's rate)"
        )
    return sample_rate


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
    """``fmt`` at ``sample_rate`` (None: ``default_rate``) from the model's float32 PCM at ``model_rate``."""

    def __init__(self, fmt: str, sample_rate: int | None = None, *, model_rate: int) -> None:
        sample_rate = check_rate(fmt, sample_rate, model_rate)
        self.fmt, self.sample_rate = fmt, sample_rate
        self._started = False
        self._closed = False
        self._pts = 0
        self.samples_out = 0
        """Samples encoded so far, at ``sample_rate``."""
        self._resampler = StreamingResampler(sample_rate, model_rate) if sample_rate != model_rate else None
        if fmt in _G711:
            import av

            self._codec = av.CodecContext.create(_G711[fmt], "w")
            self._codec.sample_rate, self._codec.layout, self._codec.format = sample_rate, "mono", "s16"
            self._codec.open()
        elif fmt in _AV:
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
        if self._resampler is not None:
            pcm = self._resampler.process(pcm)
        self.samples_out += len(pcm)
        return self._encode(pcm)

    def _encode(self, pcm: np.ndarray) -> bytes:
        """``pcm``, at ``sample_rate`` already, into the format."""
        if self.fmt == "pcm":
            return to_pcm16(pcm)
        if self.fmt == "wav":
            head = b"" if self._started else wav_header(None, self.sample_rate)
            self._started = True
            return head + to_pcm16(pcm)
        if self.fmt in _G711:
            return b"".join(bytes(p) for p in self._codec.encode(self._frame(pcm))) if len(pcm) else b""
        if len(pcm) == 0:
            return self._sink.drain()
        for packet in self._stream.encode(self._frame(pcm)):
            self._container.mux(packet)
        return self._sink.drain()

    def _frame(self, pcm: np.ndarray):
        import av

        samples = np.frombuffer(to_pcm16(pcm), dtype="<i2")[None, :]
        frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
        frame.sample_rate = self.sample_rate
        frame.pts = self._pts
        self._pts += samples.shape[1]
        return frame

    def finish(self) -> bytes:
        """Flush everything; the bytes returned complete the stream."""
        if self._closed:
            return b""
        head = b""
        if self._resampler is not None:  # the filter's last samples
            tail = self._resampler.flush()
            self.samples_out += len(tail)
            head = self._encode(tail)
        if self._pts == 0 and self.fmt in _NEEDS_A_FRAME:  # no audio at all: still a file its decoder opens
            head = self._encode(np.zeros(1, np.float32))  # (filler, not counted in samples_out)
        self._closed = True
        if self.fmt in ("pcm", *_G711):  # (G.711 encoders hold nothing back)
            return head
        if self.fmt == "wav":
            return head if self._started else wav_header(None, self.sample_rate)
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


def encode_whole(audio: np.ndarray, fmt: str, sample_rate: int | None = None, *, model_rate: int) -> bytes:
    """A complete file (wav with exact sizes) of the model's audio, at ``sample_rate`` (as ``StreamingEncoder``)."""
    rate = check_rate(fmt, sample_rate, model_rate)
    if fmt == "wav":
        audio = resample(audio, rate, model_rate)
        return wav_header(len(audio), rate) + to_pcm16(audio)
    enc = StreamingEncoder(fmt, rate, model_rate=model_rate)
    return enc.write(audio) + enc.finish()
