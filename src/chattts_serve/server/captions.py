"""Sentence timestamps: each sentence's place in the audio as events (SSE, WebSocket) and as subtitles.

The engine counts them (``engine.outputs.SegmentSpan``: sentences are back to back in the audio, so sentence
i starts where sentence i-1 ends, in samples at the model's rate); nothing here estimates. A caption's text is the
sentence as normalised, without control tokens. Word timing is counted where the model predicts durations
(``SegmentSpan.words``, a family with word timestamps).
Times are seconds of the model's audio; at another ``sample_rate`` the resampled audio has the same duration.
"""

from __future__ import annotations

from ..engine.outputs import RequestOutput, SegmentSpan

CAPTION_MEDIA_TYPES = {"srt": "application/x-subrip", "vtt": "text/vtt"}


class SegmentClock:
    """A request's sentences as their audio completes, each once and in order. ``offset``: samples of the
    stream before this request (a WebSocket session's earlier parts); ``first_index``: its sentences before.
    Reads the deltas' ``spans``; the final output's segments stand in for any the deltas did not carry (a
    result replayed rather than generated)."""

    def __init__(self, offset: int = 0, first_index: int = 0) -> None:
        self.offset, self.next_index = offset, first_index
        self.spans: list[SegmentSpan] = []
        """Every sentence reported so far, placed in the stream."""
        self._seen = 0  # sentences of this request reported
        self._untaken = 0

    def feed(self, chunk: RequestOutput) -> list[SegmentSpan]:
        """The sentences this delta completes."""
        spans = list(chunk.spans)
        if chunk.finished and chunk.segments:
            spans += [s.span for s in chunk.segments if s.span is not None]
        new = []
        for span in spans:
            if span.index >= self._seen:
                self._seen = span.index + 1
                new.append(span.shifted(self.offset, self.next_index))
                self.next_index += 1
        self.spans += new
        return new

    def take(self) -> list[SegmentSpan]:
        """The sentences fed since the last ``take`` (for a caller that feeds from a callback)."""
        new, self._untaken = self.spans[self._untaken :], len(self.spans)
        return new


def segment_event(span: SegmentSpan, event_type: str) -> dict:
    """One sentence as an event (``speech.segment`` in OpenAI's SSE, ``segment`` on the WebSocket)."""
    return {"type": event_type, **segment_fields(span)}


def segment_fields(span: SegmentSpan) -> dict:
    return {"index": span.index, "text": span.text, "start_s": span.start_s, "end_s": span.end_s}


def subtitles(spans: list[SegmentSpan], fmt: str) -> str:
    """SubRip (``srt``) or WebVTT (``vtt``): one cue per sentence, times rounded to the millisecond (a cue
    ends where the next begins). Sentences without audio or without text have no cue."""
    cues = [s for s in spans if s.end > s.start and s.text.strip()]
    if fmt == "srt":
        return "\n".join(
            f"{n}\n{_timestamp(s.start, s.sample_rate, ',')} --> {_timestamp(s.end, s.sample_rate, ',')}\n"
            f"{_one_line(s.text)}\n"
            for n, s in enumerate(cues, 1)
        )
    if fmt == "vtt":
        body = [
            f"{_timestamp(s.start, s.sample_rate, '.')} --> {_timestamp(s.end, s.sample_rate, '.')}\n"
            f"{_vtt_text(s.text)}\n"
            for s in cues
        ]
        return "\n".join(["WEBVTT\n", *body])
    raise ValueError(f"unknown caption format {fmt!r}; choose one of {', '.join(CAPTION_MEDIA_TYPES)}")


def _timestamp(samples: int, rate: int, separator: str) -> str:
    ms = (samples * 1000 + rate // 2) // rate
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    seconds, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{seconds:02d}{separator}{ms:03d}"


def _one_line(text: str) -> str:
    # A blank line would end the cue, and "-->" would read as a timing line.
    return " ".join(text.split()).replace("-->", "->")


def _vtt_text(text: str) -> str:
    # WebVTT cue text is markup: "&" and "<" start an entity or a tag.
    return _one_line(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
