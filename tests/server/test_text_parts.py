"""server/text_parts.py: streamed text cut into sentences however it was chunked (Home Assistant forwards an
LLM's text in chunks that split words and numbers)."""

from __future__ import annotations

import random

import pytest

from chattts_serve.server.text_parts import Segmenter, _ends

TEXTS = [
    "今天气温是 23.5 度。明天会下雨！你带伞了吗？好的",
    "The forecast says 23.5 degrees. See dapr.io for details! Is that right? Yes...\nOK",
    "Version 1.2.3 is out. Mr. Smith said so.",
]


# Where each text's sentences end (offsets just after the end), as a reader sees them.
SENTENCE_ENDS = [
    [
        len("今天气温是 23.5 度。"),
        len("今天气温是 23.5 度。明天会下雨！"),
        len("今天气温是 23.5 度。明天会下雨！你带伞了吗？"),
    ],
    [31, 56, 71, 78, 79],
    [21, 25, 40],
]


def test_numbers_and_domains_are_not_sentence_ends():
    for text, ends in zip(TEXTS, SENTENCE_ENDS, strict=True):
        decided = [e for e in ends if e < len(text) or text[-1] not in ".!?"]  # a final "." waits for more
        assert _ends(text, 0) == decided, text


@pytest.mark.parametrize(("text", "ends"), list(zip(TEXTS, SENTENCE_ENDS, strict=True)))
@pytest.mark.parametrize("seed", range(20))
def test_chunks_cut_anywhere_give_parts_cut_at_sentence_ends(text, ends, seed):
    """Chunks of 1-4 characters (mid-word, mid-number, a full stop at a chunk's end): every part but the last
    ends at a sentence end, nothing is lost, and the first sentence leaves once its end is decided (no later
    than the chunk after the one that holds it)."""
    rng = random.Random(seed)
    segmenter, spoken, first_at, i, n_chunks = Segmenter(1000), [], None, 0, 0
    while i < len(text):
        n = rng.randint(1, 4)
        out = segmenter.feed(text[i : i + n])
        i += n
        n_chunks += 1
        if out and first_at is None:
            first_at = i
        spoken += out
    spoken += segmenter.flush()
    assert "".join(spoken) == text
    offsets = [sum(len(p) for p in spoken[: k + 1]) for k in range(len(spoken) - 1)]
    assert set(offsets) <= set(ends), (spoken, ends)
    assert first_at is not None and first_at <= ends[0] + 4, (first_at, ends[0])


def test_a_full_stop_at_a_chunks_end_waits_for_the_next_chunk():
    segmenter = Segmenter(1000)
    assert segmenter.feed("It is 23.") == []  # 23.5, or the end of a sentence?
    assert segmenter.feed("5 degrees. Next") == ["It is 23.5 degrees."]
    assert segmenter.feed("。") == [" Next。"]  # a CJK full stop is always an end
    assert segmenter.feed("Done.") == []
    assert segmenter.flush() == ["Done."]  # the end of the stream decides
