"""An SSML subset -> the text ChatTTS speaks (control tokens included) and the request's speaking rate.

A request's text that is an XML document whose root is ``<speak>`` is SSML (``is_ssml``): ``<speak`` first,
or after what generators put before it (a byte-order mark, whitespace, the ``<?xml ...?>`` declaration,
comments, processing instructions; a DOCTYPE there makes it SSML too, which ``parse_ssml`` then refuses). The
engine's input processing turns it into plain text here, before sentence splitting and normalisation. Tags:

* ``<speak>`` (root; ``xml:lang`` zh/en picks the language of say-as words), ``<p>``, ``<s>`` (kept as text);
* ``<break time="500ms"/>`` / ``strength="none|x-weak|weak|medium|strong|x-strong"``: ChatTTS's break tokens,
  ``[uv_break]`` (a short pause, up to ``SHORT_BREAK_MS``) or ``[lbreak]`` (longer; also for breaks longer
  than the model can pause: ChatTTS has no timed silence, and inserting silence is the audio stage's work);
* ``<prosody rate="x-slow|slow|medium|fast|x-fast|NN%|+NN%|-NN%|1.5">``: a ``[speed_N]`` for the text inside.
  Text at one rate gives the request's prompt that rate (``SsmlText.speed``); text at several is cut into
  its rate runs (``SsmlText.runs``), each spoken as sentences of its own with its own ``[speed_N]``;
* ``<say-as interpret-as="characters|spell-out|digits|telephone|date" format=...>`` (``text/say_as.py``);
* ``<sub alias="...">``: the alias is spoken instead of the content;
* ``<phoneme alphabet="pinyin" ph="chang2">长</phoneme>``: one unambiguous homophone per syllable
  (``text/lexicon.py``);
* ``<voice name="...">``: a change of voice. The engine speaks one request in one voice, so ``voice_runs``
  splits a document into its voice runs, each an SSML document of its own, which the server speaks as the
  turns of a dialogue (``server/ssml_turns.py``); ``parse_ssml`` reads one run and refuses ``<voice>``.

Any other tag or attribute, and malformed XML, is a ValueError naming it and its line and column (the
W3C's ``xmlns``, ``xml:lang`` and ``xsi:schemaLocation`` on ``<speak>`` are taken as they are written). Parsing
is expat's (a real XML parser) with a size and depth bound; a DOCTYPE (and so any entity declaration: the
entity-expansion bombs) is refused before anything is expanded; only XML's five predefined entities and
character references are read. Whitespace runs become one space, as SSML processors do. What the document
says is bounded too (``limit``: the lexicon and ``<say-as>`` lengthen text), counted as it is written out
(``text.bound``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from xml.parsers import expat
from xml.sax.saxutils import escape, quoteattr

from ..sampling_params import speed_prompt
from .bound import TextTooLong
from .lexicon import Lexicon, pinyin_to_text
from .normalize import detect_language
from .say_as import DATE_FORMATS, INTERPRET_AS, say_as

MAX_SSML_CHARS = 20_000
MAX_DEPTH = 32
MAX_ELEMENTS = 2_000
SHORT_BREAK_MS = 300
"""A break up to this long is ``[uv_break]``; a longer one ``[lbreak]``."""

_SSML_NS = "http://www.w3.org/2001/10/synthesis"
_XML_NS = "http://www.w3.org/XML/1998/namespace"
_XSI_NS = "http://www.w3.org/2001/XMLSchema-instance"  # xsi:schemaLocation, as the W3C's examples write it
_ROOT = re.compile(r"<speak[\s/>]")
_DECLARATION = re.compile(r"\ufeff?\s*<\?xml\s[^>]*\?>")
_TIME = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s)\s*$")
_BLANKS = re.compile(r"\s+")
_STRENGTHS = {
    "none": "",
    "x-weak": "[uv_break]",
    "weak": "[uv_break]",
    "medium": "[uv_break]",
    "strong": "[lbreak]",
    "x-strong": "[lbreak]",
}
_RATES = {"x-slow": 0.5, "slow": 0.75, "medium": 1.0, "default": 1.0, "fast": 1.5, "x-fast": 2.0}
# Tag -> the attributes it takes (xml:lang is written "lang").
_TAGS: dict[str, frozenset[str]] = {
    "speak": frozenset({"version", "lang"}),
    "p": frozenset({"lang"}),
    "s": frozenset({"lang"}),
    "break": frozenset({"time", "strength"}),
    "prosody": frozenset({"rate"}),
    "say-as": frozenset({"interpret-as", "format", "detail"}),
    "sub": frozenset({"alias"}),
    "phoneme": frozenset({"alphabet", "ph"}),
    "voice": frozenset({"name"}),
}
_TEXT_ONLY = ("say-as", "sub", "phoneme")  # their content is replaced, so it may not hold tags


def is_ssml(text: str) -> bool:
    """Whether a request's text is SSML: an XML document whose root is ``<speak>``, that is ``<speak`` after
    the prologue (``_prologue_end``). A DOCTYPE in the prologue of a document with a ``<speak>`` makes it
    SSML as well: it is refused (``parse_ssml``), not spoken as text."""
    start = _prologue_end(text)
    if _ROOT.match(text, start):
        return True
    return text.startswith("<!DOCTYPE", start) and _ROOT.search(text, start) is not None


def _prologue_end(text: str) -> int:
    """Where the text starts after a byte-order mark and the XML prologue's whitespace, declaration,
    comments and processing instructions (one pass, no backtracking: linear in the text)."""
    i, n = (1 if text.startswith("\ufeff") else 0), len(text)
    while True:
        while i < n and text[i].isspace():
            i += 1
        for opener, closer in (("<?", "?>"), ("<!--", "-->")):
            if text.startswith(opener, i):
                end = text.find(closer, i + len(opener))
                if end < 0:
                    return i
                i = end + len(closer)
                break
        else:
            return i


@dataclass(frozen=True, slots=True)
class SsmlText:
    text: str
    """What to speak: plain text with ChatTTS control tokens."""
    speed: str | None = None
    """``[speed_N]`` when all the text asks for one rate (``<prosody rate>``); None: the request's prompt, or
    several rates (``runs``)."""
    runs: tuple[tuple[str, str | None], ...] = ()
    """With text at several rates: (text, ``[speed_N]`` or None for the request's prompt) of each stretch at
    one rate, in order (their texts joined are ``text``); breaks belong to the stretch they follow. Empty
    when there is one rate."""
    rate: float | None = field(default=None, compare=False)
    """The rate ``speed`` was made from (1 = normal), for a model whose speed is a number (Kokoro); ``speed``
    says the same for ChatTTS, so equality is theirs (and ``run_rates``')."""
    run_rates: tuple[float | None, ...] = field(default=(), compare=False)
    """The rate each of ``runs`` was made from (None: the request's)."""


@dataclass(slots=True)
class _Element:
    tag: str
    attrs: dict[str, str]
    where: str
    children: list[_Element | str] = field(default_factory=list)


def parse_ssml(
    text: str, lang: str | None = None, lexicon: Lexicon | None = None, limit: int | None = None
) -> SsmlText:
    """``text`` (SSML) as ``SsmlText``. ``lang``: the request's ("zh"/"en"; None: ``xml:lang``, else
    detected); ``lexicon``: applied to the document's own text (not to say-as, sub or phoneme output);
    ``limit``: the most characters what it says may have (``TextTooLong`` as soon as it passes them).
    ``<voice>`` is refused: split the document with ``voice_runs`` first."""
    return _spoken(_read(text), lang, lexicon, limit)


def _read(text: str) -> _Element:
    """The document's tree, within the bounds; any fault a ValueError naming its place."""
    if len(text) > MAX_SSML_CHARS:
        raise ValueError(f"SSML has {len(text)} characters; the limit is {MAX_SSML_CHARS}")
    for decl in ("<!DOCTYPE", "<!ENTITY"):
        if decl in text:
            raise ValueError(f"SSML must not have a DOCTYPE or entity declarations ({decl} at {_position(text, decl)})")
    return _parse(_without_declaration(text))


def _without_declaration(text: str) -> str:
    """``text`` with its byte-order mark and XML declaration blanked out (spaces; line breaks kept, so
    positions stay those of ``text``): expat takes a declaration only at the very start, and a generator's
    whitespace or BOM before it is no fault of the document's. The text is a str, so the declaration's
    encoding says nothing."""
    m = _DECLARATION.match(text)
    if m is None:
        return " " + text[1:] if text.startswith("\ufeff") else text
    return "".join(c if c == "\n" else " " for c in m.group()) + text[m.end() :]


def _spoken(root: _Element, lang: str | None, lexicon: Lexicon | None, limit: int | None = None) -> SsmlText:
    lang = lang or _lang_of(root) or detect_language(_plain(root))
    pieces: list[tuple[str, float | None]] = []  # (text, its rate: None outside <prosody rate>)
    _render(root, lang, lexicon, None, _Budget(limit), pieces)
    runs: list[tuple[list[str], float | None]] = []  # the stretches at one rate; neutral pieces join the last
    for piece, rate in pieces:
        if runs and (runs[-1][1] == rate or _neutral(piece)):
            runs[-1][0].append(piece)
        elif runs and all(_neutral(p) for p in runs[-1][0]):
            runs[-1] = ([*runs[-1][0], piece], rate)  # what came first (breaks) goes with the first text
        else:
            runs.append(([piece], rate))
    spoken = [_BLANKS.sub(" ", "".join(texts)) for texts, _ in runs]
    text = "".join(spoken).strip()
    if len(runs) <= 1:
        rate = runs[0][1] if runs else None
        return SsmlText(text, speed_prompt(rate) if rate is not None else None, rate=rate)
    spoken[0], spoken[-1] = spoken[0].lstrip(), spoken[-1].rstrip()
    speeds = [speed_prompt(rate) if rate is not None else None for _, rate in runs]
    rates = tuple(rate for _, rate in runs)
    return SsmlText(text, None, tuple(zip(spoken, speeds, strict=True)), run_rates=rates)


def _neutral(piece: str) -> bool:
    """Nothing to say at a rate (whitespace, break tokens): it joins the run in progress."""
    return not piece.strip() or _only_tokens(piece)


class _Budget:
    """The characters a document's spoken text may have (None: no bound), counted as it is written out."""

    def __init__(self, limit: int | None) -> None:
        self.limit, self.used = limit, 0

    @property
    def left(self) -> int | None:
        return None if self.limit is None else self.limit - self.used

    def take(self, piece: str, what: str) -> str:
        self.used += len(piece)
        if self.limit is not None and self.used > self.limit:
            raise TextTooLong(self.limit, what)
        return piece


@dataclass(frozen=True, slots=True)
class VoiceRun:
    """A stretch of a document spoken in one voice: a dialogue turn."""

    voice: str | None
    """The ``<voice name>`` that speaks it; None: the request's voice (text outside any ``<voice>``)."""
    where: str | None
    """Where that ``<voice>`` starts (``line L, column C``), for the messages that name it."""
    ssml: str
    """The run as an SSML document of its own (``parse_ssml`` reads it): the elements around its text are
    kept (a ``<prosody>`` around two voices applies to both), the ``<voice>`` elements are not."""


def voice_runs(text: str) -> list[VoiceRun]:
    """``text`` (SSML) cut where the voice changes, in order. ``<voice>`` may nest: text is spoken by its
    innermost ``<voice>``, and the outer voice speaks again after the inner one closes. Breaks and text with
    nothing to say (whitespace, punctuation) belong to the run in progress, so a pause between two voices
    ends the first one's turn. Without any ``<voice>`` the one run is ``text`` itself, as it was.

    Every run is checked here as ``parse_ssml`` would check it (each run may have its own ``<prosody
    rate>``), so a fault is a ValueError naming its place in ``text``, not in a run."""
    root = _read(text)
    if not _has_voice(root):
        return [VoiceRun(None, None, text)]
    runs: list[tuple[_Element | None, list[_Leaf]]] = []
    pending: list[_Leaf] = []  # leaves with nothing to say before the first run
    for leaf in _leaves(root, (), None):
        if runs and (leaf.neutral or _name(leaf.voice) == _name(runs[-1][0])):
            runs[-1][1].append(leaf)
        elif leaf.neutral:
            pending.append(leaf)
        else:
            runs.append((leaf.voice, pending + [leaf]))
            pending = []
    if not runs:  # nothing to say anywhere: one run, which the engine refuses as it refuses any such text
        runs = [(None, pending)]
    out = []
    for voice, leaves in runs:
        doc = _rebuilt(leaves)
        _spoken(doc, None, None, MAX_SSML_CHARS)  # its faults, named at their place in text
        out.append(VoiceRun(_name(voice), voice.where if voice is not None else None, _xml(doc)))
    return out


@dataclass(frozen=True, slots=True)
class _Leaf:
    """A piece of a document that goes whole into one run: text, or an element whose content is replaced or
    empty; with the elements around it (the root first, no ``<voice>``) and its innermost ``<voice>``."""

    item: _Element | str
    path: tuple[_Element, ...]
    voice: _Element | None

    @property
    def neutral(self) -> bool:
        """Nothing to say: it joins whichever run is in progress."""
        if isinstance(self.item, str):
            return not any(ch.isalnum() for ch in self.item)
        return self.item.tag == "break"


def _has_voice(el: _Element) -> bool:
    return el.tag == "voice" or any(isinstance(c, _Element) and _has_voice(c) for c in el.children)


def _name(voice: _Element | None) -> str | None:
    return voice.attrs["name"].strip() if voice is not None else None


def _leaves(el: _Element, path: tuple[_Element, ...], voice: _Element | None):
    if el.tag == "voice":
        if not el.attrs.get("name", "").strip():
            raise ValueError(f"<voice> at {el.where}: name is required (a voice, as a request's voice field takes)")
        voice = el
    else:
        path = (*path, el)
    for child in el.children:
        if isinstance(child, str) or child.tag in ("break", *_TEXT_ONLY):
            yield _Leaf(child, path, voice)
        else:
            yield from _leaves(child, path, voice)


def _rebuilt(leaves: list[_Leaf]) -> _Element:
    """The document of one run: its leaves (in order) inside copies of the elements around them."""
    copies: dict[int, _Element] = {}
    for leaf in leaves:
        parent = None
        for el in leaf.path:
            copy = copies.get(id(el))
            if copy is None:
                copy = copies[id(el)] = _Element(el.tag, el.attrs, el.where)
                if parent is not None:
                    parent.children.append(copy)
            parent = copy
        parent.children.append(leaf.item)
    return copies[id(leaves[0].path[0])]


def _xml(el: _Element) -> str:
    attrs = "".join(f" {'xml:lang' if k == 'lang' else k}={quoteattr(v)}" for k, v in el.attrs.items())
    inner = "".join(escape(c) if isinstance(c, str) else _xml(c) for c in el.children)
    return f"<{el.tag}{attrs}>{inner}</{el.tag}>"


def _parse(text: str) -> _Element:
    parser = expat.ParserCreate(namespace_separator=" ")
    parser.SetParamEntityParsing(expat.XML_PARAM_ENTITY_PARSING_NEVER)
    stack: list[_Element] = []
    done: list[_Element] = []
    count = 0

    def where() -> str:
        return f"line {parser.CurrentLineNumber}, column {parser.CurrentColumnNumber + 1}"

    def refuse_doctype(*_args) -> None:
        raise ValueError(f"SSML must not have a DOCTYPE or entity declarations ({where()})")

    def start(name: str, attrs: dict[str, str]) -> None:
        nonlocal count
        tag = _local(name, where())
        count += 1
        if count > MAX_ELEMENTS or len(stack) >= MAX_DEPTH:
            raise ValueError(f"SSML has more than {MAX_ELEMENTS} elements or is nested deeper than {MAX_DEPTH}")
        if tag not in _TAGS:
            raise ValueError(f"unknown SSML tag <{tag}> at {where()}; known: {', '.join(f'<{t}>' for t in _TAGS)}")
        if (tag == "speak") != (not stack):
            raise ValueError(f"<{tag}> at {where()}: <speak> is the root and only the root")
        if stack and stack[-1].tag in _TEXT_ONLY:
            raise ValueError(f"<{tag}> at {where()}: <{stack[-1].tag}> holds text only")
        plain = {}
        for key, value in attrs.items():
            local = key.split(" ")[-1]
            if tag == "speak" and key.startswith(_XSI_NS + " "):
                continue  # where the schema is: nothing to speak
            if (" " in key and not key.startswith(_XML_NS + " ")) or local not in _TAGS[tag]:
                raise ValueError(f"<{tag}> at {where()}: unsupported attribute {local!r}")
            plain[local] = value
        el = _Element(tag, plain, where())
        if stack:
            stack[-1].children.append(el)
        stack.append(el)

    def end(name: str) -> None:
        done.append(stack.pop())

    def chars(data: str) -> None:
        if stack:
            stack[-1].children.append(data)

    parser.StartDoctypeDeclHandler = refuse_doctype
    parser.EntityDeclHandler = refuse_doctype
    parser.StartElementHandler = start
    parser.EndElementHandler = end
    parser.CharacterDataHandler = chars
    try:
        parser.Parse(text, True)
    except expat.ExpatError as exc:
        opened = f" (inside <{stack[-1].tag}> from {stack[-1].where})" if stack else ""
        raise ValueError(
            f"malformed SSML at line {exc.lineno}, column {exc.offset + 1}: {expat.ErrorString(exc.code)}{opened}"
        ) from None
    return done[-1]


def _position(text: str, what: str) -> str:
    before = text[: text.index(what)]
    return f"line {before.count(chr(10)) + 1}, column {len(before) - before.rfind(chr(10))}"


def _local(name: str, where: str) -> str:
    ns, _, local = name.rpartition(" ")
    if ns and ns != _SSML_NS:
        raise ValueError(f"unknown SSML tag <{local}> at {where} (namespace {ns!r})")
    return local


def _lang_of(root: _Element) -> str | None:
    value = root.attrs.get("lang", "").lower()
    return "zh" if value.startswith("zh") else "en" if value.startswith("en") else None


def _plain(el: _Element) -> str:
    return "".join(c if isinstance(c, str) else _plain(c) for c in el.children)


def _only_tokens(text: str) -> bool:
    return not re.sub(r"\[\w+\]", "", text).strip()


def _render(
    el: _Element,
    lang: str,
    lexicon: Lexicon | None,
    rate: float | None,
    budget: _Budget,
    out: list[tuple[str, float | None]],
) -> None:
    a, tag = el.attrs, el.tag
    if tag == "voice":
        raise ValueError(
            f"<voice> at {el.where}: a change of voice is a dialogue turn, and here the text is spoken in one "
            "voice; send it to POST /v1/audio/speech or /v1/tts, which speak each <voice> as a turn"
        )
    if tag == "break":
        if any(isinstance(c, _Element) or c.strip() for c in el.children):
            raise ValueError(f"<break> at {el.where} must be empty")
        out.append((budget.take(_break(a, el.where), "SSML's breaks"), None))
        return
    if tag in _TEXT_ONLY:
        out.append((budget.take(_replace(tag, a, _plain(el), lang, el.where), f"SSML's <{tag}>"), rate))
        return
    if tag == "prosody" and "rate" in a:
        rate = _rate(a["rate"], rate, el.where)
    for child in el.children:
        if isinstance(child, str):
            said = lexicon.apply(child, budget.left) if lexicon is not None else child
            out.append((budget.take(said, "the lexicon's replacements"), rate))
        else:
            _render(child, lang, lexicon, rate, budget, out)


def _break(a: dict[str, str], where: str) -> str:
    if "time" in a:
        m = _TIME.match(a["time"])
        if m is None:
            raise ValueError(f"<break> at {where}: time must be like 500ms or 1.5s, got {a['time']!r}")
        ms = float(m.group(1)) * (1000 if m.group(2) == "s" else 1)
        return "" if ms == 0 else "[uv_break]" if ms <= SHORT_BREAK_MS else "[lbreak]"
    strength = a.get("strength", "medium")
    if strength not in _STRENGTHS:
        raise ValueError(f"<break> at {where}: strength must be one of {', '.join(_STRENGTHS)}, got {strength!r}")
    return _STRENGTHS[strength]


def _rate(value: str, current: float | None, where: str) -> float:
    v = value.strip()
    try:
        if v in _RATES:
            return _RATES[v]
        if v.endswith("%"):
            number = float(v[:-1])
            rate = (current or 1.0) * (1 + number / 100) if v[0] in "+-" else number / 100
        else:
            rate = float(v)
    except ValueError:
        rate = math.nan
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(
            f"<prosody> at {where}: rate must be x-slow, slow, medium, fast, x-fast, NN%, +NN%, -NN% or a "
            f"number > 0, got {value!r}"
        )
    return rate


def _replace(tag: str, a: dict[str, str], content: str, lang: str, where: str) -> str:
    try:
        if tag == "sub":
            if "alias" not in a:
                raise ValueError("alias is required")
            return a["alias"]
        if tag == "phoneme":
            if a.get("alphabet") != "pinyin":
                raise ValueError(f'only alphabet="pinyin" is supported, got {a.get("alphabet")!r}')
            if not a.get("ph", "").strip():
                raise ValueError('ph is required (e.g. ph="chang2")')
            return pinyin_to_text(a["ph"])
        kind = a.get("interpret-as")
        if kind not in INTERPRET_AS:
            raise ValueError(f"interpret-as must be one of {', '.join(INTERPRET_AS)}, got {kind!r}")
        fmt = a.get("format")
        if fmt is not None and kind != "date":
            raise ValueError(f"format is for dates only (one of {', '.join(DATE_FORMATS)})")
        return say_as(kind, content.strip(), lang, fmt)
    except ValueError as exc:
        raise ValueError(f"<{tag}> at {where}: {exc}") from None
