"""The bound on a request's text after every expansion (the lexicon, SSML's ``<sub>`` and ``<say-as>``,
markdown cleanup, normalisation), counted as the text grows, so that a short text that expands past it is
refused after a bounded amount of work instead of after all of it.

A request's raw text is bounded by the server (``max_input_chars``); a lexicon entry may replace one
character with 256, and a ``<say-as>`` digit is a word: without this bound a 4 KB request could make the
engine split, normalise and tokenise a megabyte of text.
"""

from __future__ import annotations


class TextTooLong(ValueError):
    """The text passes its bound (``limit`` characters) after ``what`` expanded it."""

    def __init__(self, limit: int, what: str) -> None:
        super().__init__(
            f"the text has more than {limit} characters after {what}; the limit is {limit} "
            "(it holds after every expansion: lexicon, SSML <sub> and <say-as>, markdown cleanup, normalisation)"
        )
        self.limit = limit


def check_chars(text: str, limit: int, what: str) -> str:
    """``text`` when it has at most ``limit`` characters; else ``TextTooLong``."""
    if len(text) > limit:
        raise TextTooLong(limit, what)
    return text
