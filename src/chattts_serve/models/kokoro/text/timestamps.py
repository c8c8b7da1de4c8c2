"""Each word's start and end from the durations the model predicted for its phonemes.

Kokoro predicts how many frames every input id lasts; the decoder turns a frame into
``samples_per_frame`` samples (600 at 24 kHz for the official config, as the package's comment says
and its ``istftnet.Decoder`` does: the last ``AdainResBlk1d`` upsamples the frames by 2, the generator
by ``prod(upsample_rates) * gen_istft_hop_size`` = 10 * 6 * 5; 40 frames a second). The rule is
``KPipeline.join_timestamps``: the first word starts 3 frames before the end of the leading boundary
id, and the space between two words is split between them, so words are contiguous. Time is counted
in half-frames and divided by ``2 * frames_per_second`` (the package's ``MAGIC_DIVISOR`` of 80).

Unlike the package, a phoneme the vocab lacks (dropped from the ids) does not shift the words after
it, and a token without phonemes consumes its own space, not the one after it: both are index
slips in ``join_timestamps`` that only show on such tokens; every other case gives the package's
times exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from chattts_serve.models.kokoro.text.tokens import Chunk

BOS_LEAD_FRAMES = 3  # join_timestamps: the first word starts max(0, dur[0] - 3) frames in


class WordTime(NamedTuple):
    word: str
    start: float  # seconds from the chunk's first sample
    end: float


def word_timestamps(
    chunk: Chunk,
    durations: Sequence[int],
    samples_per_frame: int,
    sample_rate: int,
    vocab: Mapping[str, int] | None = None,
) -> list[WordTime]:
    """``(word, start_s, end_s)`` for every token of ``chunk`` that has phonemes.

    ``durations``: frames per input id, the two boundary ids included (``len(phonemes_to_ids(...))``
    values). ``vocab``: the one the ids were made with, so that symbols it lacks (dropped from the ids)
    are skipped here too; without it every phoneme must have an id.
    """
    ps = chunk.phonemes
    counted = [1 if vocab is None or p in vocab else 0 for p in ps]
    before = [0]  # before[k]: ids (BOS included) that precede phoneme character k
    for c in counted:
        before.append(before[-1] + c)
    before = [b + 1 for b in before]
    n_ids = before[-1] + 1
    dur = [int(d) for d in durations]
    if len(dur) != n_ids:
        hint = "" if vocab is not None else "; pass the vocab the ids were made with (symbols it lacks have no id)"
        raise ValueError(f"durations: {len(dur)} values for {n_ids} input ids (2 boundaries + {n_ids - 2} phonemes)"
                         + hint)
    prefix = [0]
    for d in dur:
        prefix.append(prefix[-1] + d)

    def frames(a: int, b: int) -> int:  # the frames of phoneme characters [a, b)
        return prefix[before[b]] - prefix[before[a]]

    divisor = 2 * sample_rate / samples_per_frame
    left = right = 2 * max(0, dur[0] - BOS_LEAD_FRAMES)
    out: list[WordTime] = []
    last = len(chunk.tokens) - 1
    for k, (token, (start, end)) in enumerate(zip(chunk.tokens, chunk.spans, strict=True)):
        gap = len(token.space)
        if end + gap <= len(ps):
            space = frames(end, end + gap)
        elif k == last and token.space and start < end:
            space = dur[-1]  # the package counts the end boundary as a last word's stripped space
        else:
            space = 0
        if start == end:
            if space and not token.phonemes:
                left = right + space
                right = left + space
            continue
        t0 = left
        left = right + 2 * frames(start, end) + space
        out.append(WordTime(token.text, t0 / divisor, left / divisor))
        right = left + space
    return out
