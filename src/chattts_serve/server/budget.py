"""One client request, one audio budget: ``max_audio_seconds`` holds for the audio the client gets, whatever
the request is made of.

A request may be several engine requests (a dialogue's turns, an SSML document's ``<voice>`` runs), silence
between them (``pause_ms``), and a time stretch over all of it (``speed_mode`` "stretch" or "both": speed 0.25
makes 4x the audio). The engine caps each of its requests on its own (``engine.input_processor``); here the
request as a whole is fitted into the limit before anything is submitted:

    (speech + pauses) / min(1, stretch) <= max_audio_seconds

counted at its longest: after a slow-down stretch (the client's audio), before a speed-up one (the engine's
work). Each turn gets an equal share of what the pauses leave, as a tighter ``max_audio_seconds`` for its
engine request, which caps each of its sentences at their share in turn. What can be known up front is
refused up front with a 400 that says why: pauses longer than ``MAX_PAUSE_SECONDS`` or than the budget, and
turns whose ``min_new_tokens`` alone pass their share. ``max_new_tokens`` is a cap, not a demand: it is
lowered to the share, as for the sentences of one text.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..models.chattts.config import TOKENS_PER_SECOND
from .errors import APIError

MAX_PAUSE_SECONDS = 60.0
"""Most silence between turns in one request (``pause_ms`` x (turns - 1)): silence costs the server no
work, so without a bound a small request buys minutes of bytes."""


def turn_budget(
    limit_s: float, min_new_tokens: Sequence[int], pause_s: float = 0.0, stretch: float = 1.0, param: str = "turns"
) -> float | None:
    """Each turn's share of one request's ``limit_s`` seconds of audio (the engine's ``max_audio_seconds``), in
    seconds of the model's audio; None when the one turn, unstretched and without pauses, has the engine's
    whole budget (nothing to pass on). ``min_new_tokens``: each turn's; ``pause_s``: the request's total
    silence; ``stretch``: its time-stretch factor (``audio.stretch``). Raises a 400 naming ``param``."""
    turns = len(min_new_tokens)
    if turns == 1 and pause_s == 0 and stretch >= 1.0:
        return None
    if pause_s > MAX_PAUSE_SECONDS:
        raise APIError(
            400, f"the pauses between turns add up to {pause_s:g} s; the limit is {MAX_PAUSE_SECONDS:g} s", param=param
        )
    room = limit_s * min(1.0, stretch)  # the model's audio and the pauses, before a slow-down stretch
    share = (room - pause_s) / turns
    if share * TOKENS_PER_SECOND < 1:
        raise APIError(400, _over(limit_s, pause_s, stretch, f"{turns} turn(s) of at least one step"), param=param)
    asked = max(min_new_tokens) / TOKENS_PER_SECOND
    if asked > share:
        what = f"{turns} turn(s) of at least {asked:.1f} s (min_new_tokens {max(min_new_tokens)})"
        raise APIError(400, _over(limit_s, pause_s, stretch, what), param=param)
    return share


def _over(limit_s: float, pause_s: float, stretch: float, what: str) -> str:
    """Why a request cannot fit: what it asks for, against the limit."""
    slowed = f", slowed {1 / stretch:g}x by speed {stretch:g}" if stretch < 1 else ""
    return (
        f"the request asks for {what} and {pause_s:g} s of pauses{slowed}: more audio than its limit of "
        f"{limit_s:g} s (max_audio_seconds: turns, pauses and stretch share it)"
    )
