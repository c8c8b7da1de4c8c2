"""Speaker-embedding and prompt-code strings, interchangeable with ``chattts==0.2.5``.

Formats (identical to ``ChatTTS.model.speaker.Speaker``):

* speaker string: base16384( raw-LZMA2[preset 9|EXTREME]( float16 bytes ) )
* prompt-code string: base16384( uint16-LE shape[2] (4 bytes) + raw-LZMA2( uint16-LE codes ) )
* speaker statistics: base16384( float16 std[D] + float16 mean[D] ) (not compressed)

Decoders never let a low-level error escape: anything malformed raises ``ValueError``.
"""

from __future__ import annotations

import lzma
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

import numpy as np
import pybase16384 as b14
import torch
import torch.nn.functional as F

__all__ = [
    "DEFAULT_SPEAKER_STATS_STRING",
    "SpeakerStats",
    "blend_speakers",
    "decode_prompt_codes",
    "decode_speaker",
    "default_speaker_stats",
    "encode_prompt_codes",
    "encode_speaker",
    "normalized_speaker_embedding",
]

_LZMA_PRESET = 9 | lzma.PRESET_EXTREME
_MIN_DICT_SIZE = 4096  # liblzma's smallest
_MAX_DICT_SIZE = 64 << 20  # preset 9's
# Upper bound on a decompressed speaker embedding (real ones are 768 * 2 bytes); stops
# decompression bombs hidden in hostile strings.
_MAX_SPEAKER_BYTES = 1 << 20


def _filters(size: int) -> list[dict]:
    """The preset's filters with a dictionary of ``size`` bytes or more (a power of two, at least liblzma's
    smallest, at most the preset's own 64 MiB)."""
    dict_size = min(max(_MIN_DICT_SIZE, 1 << max(size - 1, 0).bit_length()), _MAX_DICT_SIZE)
    return [{"id": lzma.FILTER_LZMA2, "preset": _LZMA_PRESET, "dict_size": dict_size}]


def _compress(data: bytes) -> bytes:
    """Raw LZMA2 at the reference's preset, with a dictionary no larger than ``data`` needs. The preset's own
    64 MiB dictionary makes liblzma set up a match finder of hundreds of MB: ~50 ms for a 1.5 KB embedding,
    on every speaker string made (built-in voices, blends, saved voices). A dictionary that holds the whole
    input reaches every match the large one does, so the bytes are the reference's (checked on embeddings
    and prompt codes: tests/model/test_speaker.py), in well under a millisecond. The raw stream does not
    record the dictionary size: any dictionary as large as the output decodes it (``_decompress``)."""
    return lzma.compress(data, format=lzma.FORMAT_RAW, filters=_filters(len(data)))


def _decompress(data: bytes, max_bytes: int, what: str) -> bytes:
    """Raw LZMA2 decode with the semantics of ``lzma.decompress(format=FORMAT_RAW)``.

    Like the standard helper, concatenated streams are decoded one after the other and a
    truncated stream is an error; unlike it, output beyond ``max_bytes`` is refused. A match reaches back
    at most the output so far, so a dictionary of ``max_bytes`` decodes every stream the preset's would (and
    a 1.5 KB embedding does not get a 64 MiB buffer: 5x faster).
    """
    out = bytearray()
    rest = data
    while True:
        dec = lzma.LZMADecompressor(format=lzma.FORMAT_RAW, filters=_filters(max_bytes))
        try:
            chunk = dec.decompress(rest, max_length=max_bytes - len(out) + 1)
        except lzma.LZMAError as exc:
            raise ValueError(f"invalid {what} string: corrupt compressed payload ({exc})") from None
        out += chunk
        if len(out) > max_bytes:
            raise ValueError(f"invalid {what} string: payload larger than {max_bytes} bytes")
        if not dec.eof:
            raise ValueError(f"invalid {what} string: truncated compressed payload")
        rest = dec.unused_data
        if not rest:
            return bytes(out)


def _b14_decode(s: object, what: str) -> bytes:
    if not isinstance(s, str):
        raise ValueError(f"{what} must be a str, got {type(s).__name__}")
    s = s.strip()
    if not s:
        raise ValueError(f"{what} string is empty")
    try:
        raw = b14.decode_from_string(s)
    except Exception as exc:  # pybase16384 raises assorted errors (even SystemError)
        raise ValueError(f"invalid {what} string: not base16384 ({exc})") from None
    if not raw:
        raise ValueError(f"invalid {what} string: not base16384 (decodes to nothing)")
    return raw


def _float16_vector(emb: object, what: str) -> np.ndarray:
    if isinstance(emb, torch.Tensor):
        arr = emb.detach().to(device="cpu", dtype=torch.float16).numpy()
    else:
        try:
            with np.errstate(over="ignore"):  # overflow -> inf, rejected below
                arr = np.asarray(emb).astype(np.float16)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{what} must be numeric: {exc}") from None
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{what} must be a non-empty 1-D vector, got shape {tuple(arr.shape)}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{what} contains non-finite values (after conversion to float16)")
    return np.ascontiguousarray(arr)


def encode_speaker(emb: torch.Tensor | np.ndarray) -> str:
    """Speaker string for a 1-D embedding (cast to float16), as ``Speaker._encode``."""
    arr = _float16_vector(emb, "speaker embedding")
    return b14.encode_to_string(_compress(arr.astype("<f2").tobytes()))


def decode_speaker(s: str, expected_dim: int | None = None) -> np.ndarray:
    """Decode a speaker string (as ``Speaker._decode``) into a writable float16 1-D array.

    Raises ``ValueError`` for anything that is not a valid, finite speaker embedding, or (when
    ``expected_dim`` is given) one of a different dimension.
    """
    raw = _decompress(_b14_decode(s, "speaker embedding"), _MAX_SPEAKER_BYTES, "speaker embedding")
    if not raw:
        raise ValueError("invalid speaker embedding string: empty embedding")
    if len(raw) % 2:
        raise ValueError(f"invalid speaker embedding string: odd payload size {len(raw)} bytes")
    arr = np.frombuffer(raw, dtype="<f2").astype(np.float16)  # astype copies -> writable
    if not np.isfinite(arr).all():
        raise ValueError("invalid speaker embedding string: contains non-finite values")
    if expected_dim is not None and arr.size != expected_dim:
        raise ValueError(f"speaker embedding has dimension {arr.size}, expected {expected_dim}")
    return arr


MIN_VOICE_SAMPLES = 2048
"""The shortest 24 kHz waveform a voice sample is taken from (4 steps of audio)."""


def encode_prompt_codes(codes: torch.Tensor | np.ndarray) -> str:
    """Prompt-code string for a ``[num_vq, T]`` integer array, as ``Speaker.encode_prompt``."""
    if isinstance(codes, torch.Tensor):
        arr = codes.detach().cpu().numpy()
    else:
        arr = np.asarray(codes)
    if arr.ndim != 2:
        raise ValueError(f"prompt codes must be 2-D [num_vq, T], got shape {tuple(arr.shape)}")
    if arr.dtype.kind not in "iub":
        raise ValueError(f"prompt codes must be integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFF):
        raise ValueError("prompt codes must lie in [0, 65535]")
    if max(arr.shape) > 0xFFFF:
        raise ValueError(f"prompt code shape {tuple(arr.shape)} does not fit the uint16 header")
    header = np.array(arr.shape, dtype="<u2").tobytes()
    return b14.encode_to_string(header + _compress(np.ascontiguousarray(arr, dtype="<u2").tobytes()))


def decode_prompt_codes(s: str) -> torch.Tensor:
    """Decode a prompt-code string into an int32 ``[num_vq, T]`` tensor (``Speaker.decode_prompt``)."""
    raw = _b14_decode(s, "prompt codes")
    if len(raw) < 4:
        raise ValueError("invalid prompt codes string: missing shape header")
    rows, cols = (int(v) for v in np.frombuffer(raw[:4], dtype="<u2"))
    nbytes = 2 * rows * cols
    payload = _decompress(raw[4:], nbytes, "prompt codes")
    if len(payload) != nbytes:
        raise ValueError(f"invalid prompt codes string: header says {rows}x{cols} but payload has {len(payload)} bytes")
    arr = np.frombuffer(payload, dtype="<u2").astype(np.int32).reshape(rows, cols)
    return torch.from_numpy(arr)


@dataclass(frozen=True, eq=False)  # eq=False: tensors have no usable ==; compare by identity
class SpeakerStats:
    """Per-dimension std / mean (float16, ``[D]``) used to sample random speakers."""

    std: torch.Tensor
    mean: torch.Tensor

    def __post_init__(self) -> None:
        for name in ("std", "mean"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float16 or t.ndim != 1:
                raise ValueError(f"SpeakerStats.{name} must be a 1-D float16 tensor")
        if self.std.shape != self.mean.shape:
            raise ValueError("SpeakerStats.std and .mean must have the same shape")

    @property
    def dim(self) -> int:
        return self.std.numel()

    @classmethod
    def from_string(cls, s: str) -> SpeakerStats:
        raw = _b14_decode(s, "speaker statistics")
        if len(raw) % 4:
            raise ValueError(f"invalid speaker statistics string: {len(raw)} bytes is not 2 * D float16 values")
        vals = torch.from_numpy(np.frombuffer(raw, dtype="<f2").astype(np.float16))
        if not torch.isfinite(vals).all():
            raise ValueError("invalid speaker statistics string: contains non-finite values")
        std, mean = vals.chunk(2)
        return cls(std=std.clone(), mean=mean.clone())

    def to_string(self) -> str:
        data = torch.cat([self.std, self.mean]).cpu().numpy().astype("<f2").tobytes()
        return b14.encode_to_string(data)

    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        """A random speaker embedding: ``randn(D, float16) * std + mean``.

        Consumes the RNG exactly like the reference ``Speaker._sample_random`` (the global RNG
        when ``generator`` is None), so equal seeds give equal speakers.
        """
        out = torch.randn(self.dim, dtype=self.std.dtype, device=self.std.device, generator=generator)
        return out.mul_(self.std).add_(self.mean)


def _read_default_stats_string() -> str:
    return (resources.files("chattts_serve") / "data" / "spk_stat.txt").read_text("utf-8").strip()


DEFAULT_SPEAKER_STATS_STRING: str = _read_default_stats_string()
"""The official 768-dim speaker statistics shipped with ChatTTS (``Config.spk_stat``)."""


@lru_cache(maxsize=1)
def _default_stats() -> SpeakerStats:
    return SpeakerStats.from_string(DEFAULT_SPEAKER_STATS_STRING)


def default_speaker_stats() -> SpeakerStats:
    """The official speaker statistics (parsed once; the tensors are shared, do not modify)."""
    return _default_stats()


def normalized_speaker_embedding(emb_fp16: torch.Tensor) -> torch.Tensor:
    """L2-normalise a speaker embedding exactly as ``Speaker.apply`` does for string input:
    ``F.normalize(p=2, dim=0, eps=1e-12)`` in float16 on the CPU. Returns float16 on the CPU."""
    emb = emb_fp16.detach().to(device="cpu", dtype=torch.float16)
    return F.normalize(emb, p=2.0, dim=0, eps=1e-12)


def blend_speakers(
    embeddings: Sequence[np.ndarray], weights: Sequence[float], stats: SpeakerStats | None
) -> np.ndarray:
    """A weighted mix of speaker embeddings (1-D, one dimension), as a float16 vector like ``decode_speaker``'s.

    The mix is taken where the sampler draws speakers: ``emb = mean + std * z`` with ``z ~ N(0, I)``
    (``SpeakerStats.sample``), so each embedding becomes its ``z = (emb - mean) / std`` and the blend is the
    weighted mean of the z's (weights normalised to sum 1), mapped back. One step on top: the mean is scaled
    to the weighted mean of the inputs' ``|z|``. A mean of k unrelated N(0, I) vectors has about 1/sqrt(k)
    of their norm, a region the sampler never reaches (``|z|`` concentrates at sqrt(D)); and since the model
    L2-normalises the embedding (``normalized_speaker_embedding``), a shorter z means a voice pulled toward
    the checkpoint's mean speaker (the midpoint of two sampled voices is measurably closer to it in angle than
    either). Scaling keeps a blend as typical as its parts, as slerp does for GAN latents. A voice blended with
    itself is that voice; the blend's z is a positive combination of the inputs' z's in the weights' ratio.

    Without ``stats`` (a checkpoint without speaker statistics) the same is done on the raw embeddings.
    Raises ``ValueError`` for mismatched shapes, a weight that is not positive and finite, or a non-finite
    result."""
    if not embeddings or len(embeddings) != len(weights):
        raise ValueError("blend_speakers needs one weight per embedding, and at least one embedding")
    w = np.asarray(weights, dtype=np.float64)
    if not (np.isfinite(w).all() and (w > 0).all()):
        raise ValueError("blend weights must be positive and finite")
    w = w / w.max()  # first to (0, 1]: the sum of a few huge weights cannot overflow
    w /= w.sum()
    emb = np.stack([np.asarray(e, dtype=np.float64) for e in embeddings])
    if emb.ndim != 2:
        raise ValueError("speaker embeddings to blend must be 1-D vectors of one dimension")
    mean, std = np.zeros(emb.shape[1]), np.ones(emb.shape[1])
    if stats is not None:
        if stats.dim != emb.shape[1]:
            raise ValueError(f"speaker embeddings have dimension {emb.shape[1]}, the statistics {stats.dim}")
        mean = stats.mean.detach().cpu().double().numpy()
        std = stats.std.detach().cpu().double().numpy()
        std = np.where(std > 0, std, 1.0)  # a constant dimension: mixed as it is
    z = (emb - mean) / std
    mix = w @ z
    norm = np.linalg.norm(mix)
    if norm > 0:
        mix *= (w @ np.linalg.norm(z, axis=1)) / norm
    return _float16_vector(mean + std * mix, "blended speaker embedding")
