"""A Hypothesis state machine drives the WebSocket ``/v1/tts/stream`` of one real server (tiny checkpoint,
small limits) with valid and invalid frames in any order: start, text, end, binary, oversized and garbage
JSON. After each session it checks what the module docstring of ``server/websocket.py`` promises:

* the session ends with an ``end`` event and close 1000, or with a fatal error event whose code the frames
  sent predict, and the close code documented for it (never a silent close, never a hang). The one close
  without an event: a message over uvicorn's ``ws_max_size`` (which ``chattts-serve serve`` sets) is refused
  by the protocol layer with a bare 1009;
* every chunk event is followed by exactly the binary frame it announces; nothing comes after the end or
  a fatal error;
* the server is still alive (``/health`` 200) after every session.

Plus a property test of the text segmenter (no text lost, parts within the limit, cuts at sentence ends).
"""

from __future__ import annotations

import json
import threading
from contextlib import ExitStack
from dataclasses import dataclass, field

import httpx
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule, run_state_machine_as_test
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from chattts_serve.server.text_parts import SENTENCE_END, Segmenter

from .conftest import HTTP_TIMEOUT, ServerProcess, start_server

pytestmark = pytest.mark.fuzz

MAX_MESSAGE_BYTES = 2048
MAX_TEXT_CHARS = 2500  # two long runs exceed it
MAX_INPUT_CHARS = 300
FLAGS = (
    "--ws-max-message-bytes",
    str(MAX_MESSAGE_BYTES),
    "--ws-max-text-chars",
    str(MAX_TEXT_CHARS),
    "--max-input-chars",
    str(MAX_INPUT_CHARS),
    "--ws-max-pending-sentences",
    "4",
    # Far above the few milliseconds between steps: a session never idles out here (test_websocket tests that).
    "--ws-idle-timeout-s",
    "10",
)
OPTIONS = {"seed": 1, "refine_text": False, "min_new_tokens": 4, "max_new_tokens": 4}
# The close code documented for each way a session ends.
CLOSE_CODES = {
    "end": 1000,
    "invalid_request": 1008,
    "invalid_message": 1008,
    "text_limit": 1008,
    "message_too_big": 1009,
    "binary_frame": 1003,
    "idle_timeout": 1001,
    "capacity": 1013,
    "synthesis_failed": 1011,
    "engine_unavailable": 1011,
    "server_error": 1011,
}
READ_TIMEOUT = HTTP_TIMEOUT
_TIMED_OUT = object()

ALPHABET = "abcxyz ABC 今天天气你好我们 。！？!?.\n,，、 0123 é☃😀\t"
small_text = st.text(alphabet=ALPHABET, max_size=60)
SENTENCES = ["你好。", "今天天气真不错。", "Hello there.", "Good morning!", "我们去公园吧？", "Wait"]
sentences = st.lists(st.sampled_from(SENTENCES), min_size=1, max_size=3).map("".join)
# Long runs (no sentence end) reach the per-session total in a few steps and are cut into parts.
long_run = st.integers(MAX_INPUT_CHARS, 1900).map(lambda n: ("ab cd " * n)[:n])
garbage = st.one_of(
    st.sampled_from(
        [
            "",
            "not json",
            "null",
            "42",
            "[]",
            "{}",
            '"text"',
            '{"type": 1}',
            '{"type": "text"}',
            '{"type": "text", "text": 5}',
            '{"type": "nonsense"}',
            '{"text": "hi"}',
            '{"type": "end", ',
            "[" * 1500,  # nesting deep enough for a RecursionError in the parser
            "[" * 900 + "]" * 900,
        ]
    ),
    st.text(max_size=80).filter(lambda s: '"start"' not in s),  # a valid start is the start rule's job
)
binary = st.binary(max_size=64)
oversize = st.integers(MAX_MESSAGE_BYTES + 1, 3 * MAX_MESSAGE_BYTES).map(
    lambda n: json.dumps({"type": "text", "text": "x" * n})
)
text_message = st.one_of(small_text, sentences).map(lambda t: json.dumps({"type": "text", "text": t}))
end_message = st.just(json.dumps({"type": "end"}))
second_start = st.just(json.dumps({"type": "start", **OPTIONS}))
# Every frame that ends a session: as its first frame, or later.
bad_first = st.one_of(garbage, text_message, end_message, oversize, binary)
bad_later = st.one_of(garbage, second_start, oversize, binary)
any_frame = st.one_of(bad_first, second_start)


def no_session(machine) -> bool:
    return machine.session is None


def session_open(machine) -> bool:
    """Started, and no frame has decided the end yet (the first frame either starts it or ends it)."""
    return machine.session is not None and machine.session.outcome is None


def session_decided(machine) -> bool:
    return machine.session is not None and machine.session.outcome is not None


@dataclass
class Session:
    """One connection, as the client sees it, and what the server must do with it."""

    ws: ClientConnection
    stack: ExitStack
    frames: list = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    started: bool = False
    text_chars: int = 0
    outcome: str | None = None
    """How the server must end the session ("end" or an error code), once a frame has decided it."""

    def read_all(self) -> None:
        """In a thread: every frame until the server closes (or says nothing for READ_TIMEOUT)."""
        try:
            while True:
                self.frames.append(self.ws.recv(timeout=READ_TIMEOUT))
        except ConnectionClosed:
            pass
        except TimeoutError:
            self.frames.append(_TIMED_OUT)
        finally:
            self.done.set()


class WebSocketMachine(RuleBasedStateMachine):
    server: ServerProcess  # set by the test

    def __init__(self) -> None:
        super().__init__()
        self.session: Session | None = None

    # ------------------------------------------------------------------ rules: one frame each
    # Preconditions steer the steps: a new session starts properly half of the time, an open one gets text
    # more often than frames that end it, and frames after the end are one rule.

    @precondition(no_session)
    @rule(
        fmt=st.sampled_from(["pcm", "wav", "mp3"]),
        initial=st.none() | sentences | st.text(ALPHABET, min_size=1, max_size=100),
    )
    def start(self, fmt, initial):
        message = {"type": "start", "format": fmt, **OPTIONS}
        if initial is not None:
            message["text"] = initial
        self._send(json.dumps(message), valid_start=True)

    @precondition(no_session)
    @rule(frame=bad_first)
    def bad_first_frame(self, frame):
        self._send(frame)

    @precondition(session_open)
    @rule(text=sentences)
    def sentence(self, text):
        self._send(json.dumps({"type": "text", "text": text}))

    @precondition(session_open)
    @rule(text=st.one_of(small_text, long_run))
    def text(self, text):
        self._send(json.dumps({"type": "text", "text": text}))

    @precondition(session_open)
    @rule()
    def end(self):
        self._send(json.dumps({"type": "end"}))

    @precondition(session_open)
    @rule(frame=bad_later)
    def bad_frame(self, frame):
        """Binary, oversized, garbage JSON or a second start."""
        self._send(frame)

    @precondition(session_decided)
    @rule(frame=any_frame)
    def after_the_end(self, frame):
        self._send(frame)

    @precondition(lambda self: self.session is not None)
    @rule()
    def finish(self):
        self._finish()

    def teardown(self):
        if self.session is not None:
            self._finish()

    # ------------------------------------------------------------------ sending, and what it must cause

    def _send(self, frame: str | bytes, valid_start: bool = False) -> None:
        session = self._session()
        if session.outcome is None:
            session.outcome = self._verdict(session, frame, valid_start)
        else:
            # Frames after the one that decided the end are sent once the server has closed: sent earlier,
            # they could arrive unread when it closes, and the TCP reset that follows can make the client
            # library drop the events it had already received (a race in the client, not the server).
            assert session.done.wait(READ_TIMEOUT + 30), "the server never closed"
        try:
            session.ws.send(frame)
        except ConnectionClosed:
            pass  # the server has already ended the session; checked in _finish

    def _session(self) -> Session:
        if self.session is None:
            stack = ExitStack()
            url = self.server.base.replace("http://", "ws://") + "/v1/tts/stream"
            self.session = Session(stack.enter_context(connect(url, open_timeout=10, close_timeout=5)), stack)
            threading.Thread(target=self.session.read_all, daemon=True).start()
        return self.session

    @staticmethod
    def _verdict(session: Session, frame: str | bytes, valid_start: bool) -> str | None:
        """The session's end this frame decides (None: the session goes on), checked in the server's order:
        binary, size, JSON, message type, then the text limit."""
        if isinstance(frame, bytes):
            return "binary_frame"
        if len(frame.encode()) > MAX_MESSAGE_BYTES:
            return "message_too_big"
        if not session.started:
            if not valid_start:
                return "invalid_request"
            session.started = True
            return _count(session, json.loads(frame).get("text", ""))
        try:
            message = json.loads(frame)
        except (ValueError, RecursionError):
            return "invalid_message"
        kind = message.get("type") if isinstance(message, dict) else None
        if kind == "end":
            return "end"
        if kind == "text" and isinstance(message.get("text"), str):
            return _count(session, message["text"])
        return "invalid_message"

    # ------------------------------------------------------------------ the invariants

    def _finish(self) -> None:
        session = self.session
        if session.outcome is None:
            self.end()  # a session the steps left open: ending it must still work
        assert session.done.wait(READ_TIMEOUT + 30), "the reader never finished"
        session.stack.close()
        self.session = None
        events = _check_frames(session.frames)
        event(f"session ended: {session.outcome}")  # --hypothesis-show-statistics shows what was covered
        event(f"chunks: {'some' if any(e['type'] == 'chunk' for e in events) else 'none'}")
        if session.outcome == "message_too_big" and not _ended(events):
            assert session.ws.close_code == 1009, session.ws.close_code  # refused by the protocol layer
        else:
            _check_ending(events, session.outcome, session.ws.close_code)
        assert self.server.proc.poll() is None, self.server.log()
        assert httpx.get(self.server.base + "/health", timeout=HTTP_TIMEOUT).status_code == 200


def _check_ending(events: list[dict], expected: str, close_code: int | None) -> None:
    if expected == "end":
        assert events[0]["type"] == "start" and events[-1]["type"] == "end", events[-3:]
    else:
        last = events[-1] if events else {}
        assert last.get("type") == "error" and last.get("code") == expected, (expected, events[-3:])
    assert close_code == CLOSE_CODES[expected], (expected, close_code)


def _count(session: Session, text: str) -> str | None:
    session.text_chars += len(text)
    return "text_limit" if session.text_chars > MAX_TEXT_CHARS else None


def _ended(events: list[dict]) -> bool:
    """Whether the last event ends the session (the end, or an error that is not a refused part)."""
    last = events[-1] if events else {}
    return last.get("type") == "end" or (last.get("type") == "error" and last.get("fatal") is not False)


def _check_frames(frames: list) -> list[dict]:
    """The events; asserts the framing: announced bytes follow each chunk event, indices count up, nothing
    after the end or a fatal error, one ending at most."""
    events, owed, ended = [], 0, False
    for frame in frames:
        assert frame is not _TIMED_OUT, f"nothing for {READ_TIMEOUT} s and no close; events: {events[-3:]}"
        if isinstance(frame, bytes):
            assert len(frame) == owed > 0, f"binary frame of {len(frame)} bytes, {owed} announced"
            owed = 0
            continue
        assert owed == 0, "an event where announced audio was due"
        assert not ended, f"a frame after the end: {frame[:200]}"
        event = json.loads(frame)
        if event["type"] == "chunk":
            assert event["index"] == sum(e["type"] == "chunk" for e in events)
            owed = event["bytes"]
        events.append(event)
        ended = _ended(events)
    assert owed == 0, "closed before the announced audio"
    parts = [e["part"] for e in events if e["type"] == "chunk"]
    assert parts == sorted(parts), "parts out of order"
    return events


@pytest.fixture(scope="module")
def fuzz_server(tiny_ckpt, tmp_path_factory):
    with start_server(tiny_ckpt, tmp_path_factory.mktemp("ws-fuzz"), *FLAGS) as srv:
        yield srv


def test_websocket_state_machine(fuzz_server):
    machine = type("Machine", (WebSocketMachine,), {"server": fuzz_server})
    # database=None: no .hypothesis directory in the working tree; every example is one or more sessions.
    run_state_machine_as_test(
        machine, settings=settings(max_examples=15, stateful_step_count=8, deadline=None, database=None)
    )


@settings(max_examples=200, deadline=None, database=None)
@given(pieces=st.lists(st.text(alphabet="ab 。!,\n", max_size=40), max_size=20), limit=st.integers(1, 30))
def test_segmenter_keeps_all_text_within_the_limit(pieces, limit):
    segmenter = Segmenter(limit)
    parts = [part for piece in pieces for part in segmenter.feed(piece)] + segmenter.flush()
    assert "".join(parts) == "".join(pieces)  # nothing lost, nothing repeated, in order
    assert all(0 < len(part) <= limit for part in parts)
    for part in parts[:-1]:
        # A part ends at a sentence end, or is a long run cut at the limit or at a space/comma past its half.
        assert SENTENCE_END.search(part[-1]) or len(part) > limit // 2, (part, limit)
