"""Input processing: one text and its ``SamplingParams`` -> a ``PreparedRequest``, before the request
reaches the engine loop. Validate, read SSML (``text/ssml.py``) or clean plain text up, apply the
pronunciation lexicon (``text/lexicon.py``), split into sentences, normalise, decode the speaker and the
voice sample. Every transport's text passes through here. Host-only and thread-safe (``AsyncEngine`` runs
it in a worker thread), so the loop never waits on text work and bad input is refused before it costs a
step.

The text's bound (``SamplingParams.max_text_chars``) holds for the text as given and after every expansion:
the lexicon and SSML count as they write (``text.bound``), so a short text that would expand a hundredfold
is refused after about the bound's worth of work; markdown cleanup and normalisation are checked after.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..audio.stretch import MAX_SPEED, MIN_SPEED
from ..models.chattts.config import AUDIO_EOS, TOKENS_PER_SECOND
from ..models.chattts.speaker import decode_prompt_codes, decode_speaker
from ..models.chattts.tokenizer import Tokenizer
from ..sampling_params import SamplingParams
from ..text.bound import TextTooLong, check_chars
from ..text.cleanup import clean_markdown
from ..text.lexicon import Lexicon
from ..text.normalize import Normalizer, split_text
from ..text.ssml import is_ssml, parse_ssml

_SPEED = re.compile(r"\[speed_\d\]")


class AudioBudgetExceeded(ValueError):
    """The request's minimum audio passes its budget (``max_audio_seconds``, or the share of it it was given)."""


@dataclass(slots=True)
class PreparedRequest:
    segments: list[str]
    """The sentences to speak, normalised (one when ``split_text`` is off)."""
    params: SamplingParams
    speaker: np.ndarray | None
    """float16 [hidden] speaker embedding."""
    sample_codes: torch.Tensor | None
    """[T_s, 4] voice-sample codes given by the request."""
    voice_step: bool = False
    """Speak the first segment alone first and use its audio as every segment's voice sample."""
    max_new_tokens: int = 0
    """Each audio pass's cap: ``params.max_new_tokens``, or less to keep the request in its budget."""
    prompts: list[str] | None = None
    """Each segment's audio prompt where they differ (SSML at several ``<prosody rate>``: each rate run's
    sentences have their own ``[speed_N]``); None: ``params.prompt`` for every segment."""
    stretches: tuple[float, ...] | None = None
    """Each segment's time-stretch factor where one differs from the response's (``params.stretch``): SSML
    ``<prosody rate>`` with ``params.speed_mode`` "stretch" or "both", the rate clamped to what a stretch
    takes; the server's encoder switches factor where a segment's audio starts (``RequestOutput.stretches``).
    None: ``params.stretch`` for all of it."""

    def prompt(self, index: int) -> str:
        """Segment ``index``'s audio prompt (the voice step, -1, speaks segment 0)."""
        return self.prompts[max(index, 0)] if self.prompts is not None else self.params.prompt


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, hidden_size: int, num_vq: int, max_audio_seconds: float) -> None:
        self.tokenizer = tokenizer
        self.normalizer = Normalizer()
        self.hidden_size = hidden_size
        self.num_vq = num_vq
        self.max_audio_seconds = max_audio_seconds

    def prepare(self, text: str, params: SamplingParams, max_audio_seconds: float | None = None) -> PreparedRequest:
        """Raises ValueError with the reason for any bad input. ``max_audio_seconds``: this request's audio
        budget when it is tighter than the engine's (a server's share of one client request that is several
        engine requests, or whose audio is stretched: ``server.budget``); None: the engine's."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        if not text.strip():
            raise ValueError("text is empty")
        limit = params.max_text_chars
        if len(text) > limit:
            raise ValueError(f"text has {len(text)} characters; the limit is {limit}")
        lexicon = _lexicon(params.lexicon)
        runs: list[tuple[str, str | None, float | None]]  # (text, its [speed_N], its rate; None: the request's)
        if is_ssml(text):  # SSML (text/ssml.py): its text, with break tokens, and perhaps its own rates
            ssml = parse_ssml(text, params.lang, lexicon, limit)
            if ssml.runs:
                runs = [(t, speed, rate) for (t, speed), rate in zip(ssml.runs, ssml.run_rates, strict=True)]
            else:
                runs = [(ssml.text, None, ssml.rate)]
            if ssml.speed is not None and params.speed_mode != "stretch":
                params = replace(params, prompt=_with_speed(params.prompt, ssml.speed))
        else:
            if params.text_cleanup == "markdown":
                text = check_chars(clean_markdown(text), limit, "markdown cleanup")
            if lexicon is not None:
                text = lexicon.apply(text, limit)
            runs = [(text, None, None)]
        # An unknown [tag] in the text is text, as in the reference (markdown links, [oral] in prose: LLM
        # output is full of them); in the prompts, which hold only control tokens, it is a mistake.
        for what, value in (("prompt", params.prompt), ("refine.prompt", params.refine.prompt)):
            unknown = self.tokenizer.unknown_tags(value)
            if unknown:
                known = ", ".join(sorted(self.tokenizer.control_tokens))
                raise ValueError(f"{what} has unknown control token(s) {', '.join(unknown)}; known: {known}")
        # Each rate run is split on its own, so a sentence never spans two rates (split_text off: a run is
        # one segment).
        # speed_mode "stretch": a rate is a time stretch instead of a [speed_N]; "both": the two.
        prompted, stretched = params.speed_mode != "stretch", params.speed_mode != "prompt"
        segments, prompts, factors, size = [], [], [], 0
        for run, speed, rate in runs:
            prompt = _with_speed(params.prompt, speed) if speed is not None and prompted else params.prompt
            factor = min(MAX_SPEED, max(MIN_SPEED, rate)) if rate is not None and stretched else params.stretch
            for piece in split_text(run) if params.split_text else [run]:
                norm = self.normalizer(
                    piece, params.do_text_normalization, params.do_homophone_replacement, params.lang
                )
                size += len(norm)
                if size > limit:
                    raise TextTooLong(limit, "normalisation")
                if norm.strip():
                    segments.append(norm)
                    prompts.append(prompt)
                    factors.append(factor)
        if not segments:
            raise ValueError(f"nothing to speak after normalisation: {''.join(r for r, _, _ in runs)!r}")
        speaker = decode_speaker(params.speaker, expected_dim=self.hidden_size) if params.speaker is not None else None
        sample = None
        if params.speaker_sample is not None:
            sample = decode_prompt_codes(params.speaker_sample).t().contiguous()  # [T_s, 4]
            if sample.numel() == 0 or sample.shape[1] != self.num_vq or int(sample.max()) >= AUDIO_EOS:
                raise ValueError("speaker_sample does not hold valid [4, T] audio codes")
        voice_step = params.split_text and params.first_sentence_voice and sample is None and len(segments) > 1
        limit = self.max_audio_seconds if max_audio_seconds is None else min(max_audio_seconds, self.max_audio_seconds)
        stretches = tuple(factors) if any(f != params.stretch for f in factors) else None
        if stretches is not None:
            # The server fitted the request at its own factor (server.budget); a run slowed down further makes
            # more audio: every run is counted at the slowest factor (conservative, and known before a step).
            limit *= min(1.0, *stretches) / min(1.0, params.stretch)
        return PreparedRequest(
            segments,
            params,
            speaker,
            sample,
            voice_step,
            _max_new_tokens(params, segments, voice_step, limit),
            prompts if len(set(prompts)) > 1 else None,
            stretches,
        )


def _max_new_tokens(params: SamplingParams, segments: list[str], voice_step: bool, limit_s: float) -> int:
    """The audio budget: refuse a request whose minimum length passes ``limit_s``; otherwise cap each audio
    pass at its share (one short request cannot ask for hours of audio from a few lines of text)."""
    passes = len(segments) + voice_step
    budget = int(limit_s * TOKENS_PER_SECOND)
    if budget < passes:  # not one step per pass: nothing could be spoken
        raise AudioBudgetExceeded(
            f"the request's audio budget ({limit_s:.2f} s) is too short for its {passes} audio passes"
        )
    if params.min_new_tokens * passes > budget:
        asked = params.min_new_tokens * passes / TOKENS_PER_SECOND
        raise AudioBudgetExceeded(
            f"the request asks for at least {asked:.0f} s of audio ({passes} audio passes x min_new_tokens "
            f"{params.min_new_tokens}); the limit is {limit_s:g} s"
        )
    return min(params.max_new_tokens, budget // passes)


def _lexicon(raw: Lexicon | Mapping[str, str] | None) -> Lexicon | None:
    """``SamplingParams.lexicon`` as a ``Lexicon`` (the server passes one; the offline API may pass a dict)."""
    return raw if raw is None or isinstance(raw, Lexicon) else Lexicon.layered(None, raw)


def _with_speed(prompt: str, speed: str) -> str:
    """``prompt`` with its ``[speed_N]`` (or none) replaced by ``speed``."""
    return _SPEED.sub(speed, prompt) if _SPEED.search(prompt) else speed + prompt
