"""Sentence and word timestamps: each sentence's place in the audio as events (SSE, WebSocket) and as subtitles.

The engine counts them (``engine.outputs.SegmentSpan``: sentences are back to back in the audio, so sentence
i starts where sentence i-1 ends, in samples at the model's rate); nothing here estimates. A caption's text is the
sentence as normalised, without control tokens. Word timing is counted where the model predicts durations
(``SegmentSpan.words``, a family whose ``capabilities.timestamps`` is "word": Kokoro): a sentence's event and its
JSON segment then carry its ``words`` in Kokoro-FastAPI's captioned-speech shape (``word``, ``start_time``,
``end_time``), and subtitles may have one cue per word.
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
    fields = {"index": span.index, "text": span.text, "start_s": span.start_s, "end_s": span.end_s}
    if span.words:
        rate = span.sample_rate
        fields["words"] = [{"word": w.text, "start_time": w.start / rate, "end_time": w.end / rate} for w in span.words]
    return fields


def subtitles(spans: list[SegmentSpan], fmt: str, unit: str = "sentence") -> str:
    """SubRip (``srt``) or WebVTT (``vtt``): one cue per sentence (``unit`` "word": per word, for a model with
    word timestamps), times rounded to the millisecond (a sentence's cue ends where the next begins). Sentences
    or words without audio or without text have no cue."""
    if unit == "word":
        cues = [(w.start, w.end, w.text, s.sample_rate) for s in spans for w in s.words]
    elif unit == "sentence":
        cues = [(s.start, s.end, s.text, s.sample_rate) for s in spans]
    else:
        raise ValueError(f"unknown caption unit {unit!r}; choose sentence or word")
    cues = [c for c in cues if c[1] > c[0] and c[2].strip()]
    if fmt == "srt":
        return "\n".join(
            f"{n}\n{_timestamp(start, rate, ',')} --> {_timestamp(end, rate, ',')}\n{_one_line(text)}\n"
            for n, (start, end, text, rate) in enumerate(cues, 1)
        )
    if fmt == "vtt":
        body = [
            f"{_timestamp(start, rate, '.')} --> {_timestamp(end, rate, '.')}\n{_vtt_text(text)}\n"
            for start, end, text, rate in cues
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
