"""A pronunciation lexicon: words -> what to say instead, applied to a request's text before normalisation.

ChatTTS reads a Chinese polyphone (长 chang2 / zhang3, 行 xing2 / hang2, 重, 着, ...) as its context
suggests, and names often wrongly. A lexicon entry fixes one word: its value is replacement text, or
pinyin with tone numbers (``"chang2"``, ``"zhang3 san1"``; 5 is the neutral tone, ``v`` or ``ü`` for
ü), which becomes, syllable by syllable, a character whose *only* reading is that syllable
(``homophone``): the model has no pinyin input, but it reads an unambiguous character one way.

The homophones come from pypinyin's data, not a hand-written table: among the characters whose single
reading in pypinyin's character dictionary is the syllable, that pypinyin's phrase dictionary never reads
otherwise, that the normaliser keeps (basic CJK block, not replaced by its homophone map), the one in the
most phrases (a proxy for a common character the tokenizer and the model know). Some syllables have no
such character (``le4``, ``zhao2``, ``zhe5``: every character read so is also read another way, or is
one the normaliser replaces): an entry asking for one is refused with a ValueError naming it.

Two sources: the server's file (``ServerConfig.lexicon``: JSON object or ``word<TAB>value`` lines) and a
request's ``lexicon`` (``SamplingParams.lexicon``); the request's entries win (``Lexicon.layered``).
Matching is longest first, left to right, and never inside a ``[control]`` token.
"""

from __future__ import annotations

import functools
import json
import re
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

from .bound import TextTooLong
from .normalize import load_default_homophones

MAX_WORD_CHARS = 64
MAX_VALUE_CHARS = 256
MAX_FILE_ENTRIES = 200_000
_SYLLABLE = re.compile(r"^([a-zü:]+)([1-5])$")
_PINYIN_VALUE = re.compile(r"^\s*[A-Za-zü:]+[1-5](?:\s+[A-Za-zü:]+[1-5])*\s*$")
_CONTROL = re.compile(r"(\[\w+\])")
_BASIC_CJK = re.compile(r"^[\u4e00-\u9fff]$")  # the normaliser deletes other ideographs


def is_pinyin(value: str) -> bool:
    """A lexicon value is pinyin when every space-separated word is letters + a tone number 1-5."""
    return _PINYIN_VALUE.match(value) is not None


def _syllable_key(syllable: str) -> str:
    """``"Lü4"``, ``"lu:4"``, ``"lv4"`` -> ``"lv4"`` (pypinyin's tone3 spelling)."""
    return syllable.strip().lower().replace("u:", "v").replace("ü", "v")


@functools.lru_cache(maxsize=4096)
def _tone3(marked: str) -> str:
    from pypinyin.contrib.tone_convert import to_tone3

    return to_tone3(marked, neutral_tone_with_five=True, v_to_u=False)


@functools.lru_cache(maxsize=1)
def _homophone_index() -> tuple[dict[str, str], frozenset[str]]:
    """(syllable -> its homophone character, every syllable pypinyin knows). Built once, on first use
    (about a second: pypinyin's two dictionaries)."""
    from pypinyin.phrases_dict import phrases_dict
    from pypinyin.pinyin_dict import pinyin_dict

    readings = {chr(cp): {_tone3(p) for p in marked.split(",")} for cp, marked in pinyin_dict.items()}
    known = frozenset(s for r in readings.values() for s in r)
    replaced = load_default_homophones()
    phrases: Counter[str] = Counter()
    read_otherwise: set[str] = set()
    for phrase, pinyins in phrases_dict.items():
        if len(phrase) != len(pinyins):
            continue
        for ch, pys in zip(phrase, pinyins, strict=True):
            single = readings.get(ch)
            if single is None or len(single) != 1:
                continue
            if {_tone3(p) for p in pys} <= single:
                phrases[ch] += 1
            else:
                read_otherwise.add(ch)
    best: dict[str, str] = {}
    for ch, r in readings.items():
        if len(r) != 1 or not _BASIC_CJK.match(ch) or ch in replaced or ch in read_otherwise or not phrases[ch]:
            continue
        (syllable,) = r
        if syllable not in best or (phrases[ch], -ord(ch)) > (phrases[best[syllable]], -ord(best[syllable])):
            best[syllable] = ch
    return best, known


def homophone(syllable: str) -> str:
    """A character whose only reading is ``syllable`` (``"chang2"`` -> 肠); ValueError when there is none."""
    key = _syllable_key(syllable)
    m = _SYLLABLE.match(key)
    index, known = _homophone_index()
    if m is None or key not in known:
        raise ValueError(f"{syllable!r} is not a pinyin syllable with a tone number 1-5 (e.g. chang2)")
    if key not in index:
        raise ValueError(
            f"no common character reads only {key} (pypinyin's data): write the replacement as text instead"
        )
    return index[key]


def pinyin_to_text(value: str) -> str:
    """``"chang2 cheng2"`` -> one homophone character per syllable."""
    return "".join(homophone(s) for s in value.split())


class Lexicon:
    """Entries (word -> replacement text or pinyin) over an optional ``base`` lexicon whose entries they
    hide. Made cheaply (entries are only checked for shape, so a request's lexicon costs the event loop
    nothing); pinyin is resolved to homophones on first use (``resolved``), in the input processor's worker
    thread. Immutable once made; compare by entries."""

    __slots__ = ("entries", "base", "where", "_lengths", "_resolved")

    def __init__(self, entries: Mapping[str, str], base: Lexicon | None = None, where: str = "lexicon") -> None:
        self.entries = dict(entries)
        self.base = base
        self.where = where
        lengths = {len(w) for w in self.entries} | (set(base._lengths) if base is not None else set())
        self._lengths = tuple(sorted(lengths, reverse=True))
        self._resolved: dict[str, str] | None = None

    @classmethod
    def from_entries(cls, raw: Mapping[str, str], where: str = "lexicon", base: Lexicon | None = None) -> Lexicon:
        """Checks ``raw``'s words and values; ValueError naming ``where`` and the entry."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where} must be an object of word -> replacement, got {type(raw).__name__}")
        for word, value in raw.items():
            _check(word, value, where)
        return cls(raw, base, where)

    @classmethod
    def layered(cls, base: Lexicon | None, raw: Mapping[str, str] | Lexicon | None) -> Lexicon | None:
        """A request's entries (``raw``) over the server's (``base``): the request's win."""
        if raw is None:
            return base
        if isinstance(raw, Lexicon):
            return raw if base is None else cls(raw._flat(), base, raw.where)
        return cls.from_entries(raw, base=base)

    def resolved(self) -> dict[str, str]:
        """This lexicon's own entries with pinyin turned into homophones (``homophone``); ValueError naming the
        entry whose pinyin has none. Computed once (a race computes the same dict twice)."""
        if self._resolved is None:
            self._resolved = {w: _resolve(w, v, self.where) for w, v in self.entries.items()}
        return self._resolved

    def _flat(self) -> dict[str, str]:
        return (self.base._flat() if self.base is not None else {}) | self.entries

    def lookup(self, word: str) -> str | None:
        """What ``word`` is replaced by (resolved), or None."""
        own = self.resolved()
        if word in own:
            return own[word]
        return self.base.lookup(word) if self.base is not None else None

    def apply(self, text: str, limit: int | None = None) -> str:
        """``text`` with every entry replaced, longest match first, left to right; ``[control]`` tokens are
        left alone and a replacement is never matched again. ``limit``: the most characters the result may
        have; ``TextTooLong`` as soon as it passes them (a replacement may be 256 times its word: the work
        stops at the bound, not after the whole expansion)."""
        out: list[str] = []
        size = 0
        for part in _CONTROL.split(text):
            size += self._apply_plain(part, out, limit, size) if not _CONTROL.fullmatch(part) else _put(out, part)
            if limit is not None and size > limit:
                raise TextTooLong(limit, "the lexicon's replacements")
        return "".join(out)

    def _apply_plain(self, text: str, out: list[str], limit: int | None, size: int) -> int:
        """Appends ``text`` with its entries replaced to ``out``; returns the characters appended (stops once
        ``size`` plus them passes ``limit``)."""
        i, n, added = 0, len(text), 0
        while i < n:
            for length in self._lengths:
                if i + length <= n:
                    value = self.lookup(text[i : i + length])
                    if value is not None:
                        added += _put(out, value)
                        i += length
                        break
            else:
                added += _put(out, text[i])
                i += 1
            if limit is not None and size + added > limit:
                break
        return added

    def __len__(self) -> int:
        return len(self._flat())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Lexicon) and self._flat() == other._flat()

    def __hash__(self) -> int:
        return hash(frozenset(self._flat().items()))

    def __repr__(self) -> str:
        return f"Lexicon({len(self)} entries)"


def _put(out: list[str], piece: str) -> int:
    out.append(piece)
    return len(piece)


def _check(word: object, value: object, where: str) -> None:
    if not isinstance(word, str) or not word.strip() or len(word) > MAX_WORD_CHARS:
        raise ValueError(f"{where}: a word must be 1-{MAX_WORD_CHARS} characters, got {word!r}")
    if "[" in word or "]" in word:
        raise ValueError(f"{where}: a word must not contain [ or ] (control tokens), got {word!r}")
    if not isinstance(value, str) or len(value) > MAX_VALUE_CHARS:
        raise ValueError(f"{where}: {word!r} must map to a string of at most {MAX_VALUE_CHARS} characters")


def _resolve(word: str, value: str, where: str) -> str:
    if not is_pinyin(value):
        return value
    try:
        return pinyin_to_text(value)
    except ValueError as exc:
        raise ValueError(f"{where}: {word!r}: {exc}") from None


def parse_lexicon_file(path: str | Path) -> dict[str, str]:
    """A JSON object, or lines ``word<TAB>value`` (blank lines and ``#`` comments skipped)."""
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("{"):
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"lexicon {path}: not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"lexicon {path}: a JSON lexicon is one object of word -> replacement")
        entries = raw
    else:
        entries = {}
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            word, tab, value = line.partition("\t")
            if not tab:
                raise ValueError(f"lexicon {path} line {number}: expected word<TAB>replacement, got {line[:80]!r}")
            entries[word.strip()] = value.strip()
    if len(entries) > MAX_FILE_ENTRIES:
        raise ValueError(f"lexicon {path}: {len(entries)} entries; the limit is {MAX_FILE_ENTRIES}")
    return entries


@functools.lru_cache(maxsize=4)
def load_lexicon(path: str | None) -> Lexicon | None:
    """The server's lexicon file (``ServerConfig.lexicon``), read and resolved once per process."""
    if not path:
        return None
    try:
        raw = parse_lexicon_file(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"lexicon {path}: cannot read it: {exc}") from None
    lexicon = Lexicon.from_entries(raw, where=f"lexicon {path}")
    lexicon.resolved()  # a bad entry fails at start-up, and requests find the homophones ready
    return lexicon
