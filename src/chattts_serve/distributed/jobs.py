"""Offline jobs: input files -> items (id, text, seed), the params each item is spoken with, output file
names, the manifest, resuming, and sharding over devices. Shared by ``chattts-serve synthesize --input``
(one process, or one per device) and ``chattts-serve ray batch`` (Ray Data), so the same input and seeds
give the same files whichever runs it.

Inputs:

* ``.txt``: one text per non-empty line; ids 0001, 0002, ... in line order (blank lines skipped).
* ``.jsonl``: one object per line: ``text``, optional ``id`` (a file-name-safe string), ``seed``, ``voice`` and
  ``options``.
* ``.parquet``: columns ``text``, optional ``id``, ``seed``, ``voice`` and ``options`` (needs pyarrow: the
  ``.[ray]`` extra).

Seeds: an item's own ``seed``, else the job's ``--seed`` (the same for every text), else none (random). A voice:
the item's own ``voice`` (the model family's voice string: a Kokoro pack or blend, a VITS speaker, a ChatTTS speaker
string), else the job's ``--speaker``. Options: the family's own request options (Kokoro's ``speed``, ``lang_code``,
``phonemes``; VITS's ``noise_scale``, ...), the item's over the job's flags (``--lang-code``, ...). Their names are
checked as the file is read; their values, and the voice, by the model as the item is spoken: a bad one fails that
item alone, with its error in the manifest.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..sampling_params import SamplingParams

logger = logging.getLogger(__name__)
MANIFEST = "manifest.jsonl"
ITEM_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
FIELDS = ("id", "text", "seed", "voice", "options")
"""What an input record may hold."""


@dataclass(frozen=True, slots=True)
class Item:
    id: str
    text: str
    seed: int | None = None
    voice: str | None = None
    """The model family's voice string (``SamplingParams.speaker``); None: the job's."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """The family's own options (``SamplingParams.options``), over the job's."""

    @property
    def file_name(self) -> str:
        return f"{self.id}.wav"


@dataclass(frozen=True, slots=True)
class ManifestEntry:
    id: str
    text: str
    file: str | None
    """The WAV's name in the output directory; None when the item failed."""
    duration: float
    seed: int | None
    error: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)


def family_option_names() -> frozenset[str]:
    """The options an item may set: every family's own request options that are not ``SamplingParams`` fields
    (those travel in ``SamplingParams.options``; which family takes which is the model's to say)."""
    from ..models import families
    from ..sampling_params import option_defaults

    return frozenset(s.name for f in families() for s in f.request_options()) - set(option_defaults())


def _check_item(where: str, item_id, text, seed, voice=None, options=None) -> Item:
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{where}: text must be a non-empty string")
    if not isinstance(item_id, str) or not ITEM_ID.fullmatch(item_id):
        raise ValueError(f"{where}: id must be 1-128 of [A-Za-z0-9_.-] not starting with '.' or '-', got {item_id!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise ValueError(f"{where}: seed must be an int in [0, 2**63), got {seed!r}")
    if voice is not None and (not isinstance(voice, str) or not voice.strip()):
        raise ValueError(f"{where}: voice must be a non-empty string, got {voice!r}")
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise ValueError(f"{where}: options must be an object of the model family's options, got {options!r}")
    if options and (unknown := sorted(set(map(str, options)) - family_option_names())):
        raise ValueError(
            f"{where}: unknown option(s) {', '.join(unknown)}; the families' options are "
            f"{', '.join(sorted(family_option_names()))}"
        )
    # None is "the default": a parquet struct column holds every row's keys, None where a row has none.
    return Item(item_id, text, seed, voice, {k: v for k, v in options.items() if v is not None})


def _records(path: Path) -> Iterable[tuple[str, dict]]:
    """(where, record) per input text."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not JSON ({exc.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{n}: expected an object with 'text'")
            yield f"{path}:{n}", record
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError("reading .parquet needs pyarrow (pip install 'chattts-serve[ray]')") from None
        for n, record in enumerate(pq.read_table(path).to_pylist(), 1):
            yield f"{path} row {n}", record
    else:  # plain text, one per line (synthesize --input's format)
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                yield str(path), {"text": line}


def read_items(path: str | Path) -> list[Item]:
    """The items of an input file (format by suffix: .jsonl, .parquet, anything else is text lines).
    Raises ValueError naming the file and line for anything it cannot use."""
    path = Path(path)
    try:
        items = []
        for i, (where, record) in enumerate(_records(path)):
            unknown = set(record) - set(FIELDS)
            if unknown:
                raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
            item_id = record.get("id")
            item_id = f"{i + 1:04d}" if item_id is None else item_id
            fields_ = (record.get(name) for name in ("text", "seed", "voice", "options"))
            items.append(_check_item(where, item_id, *fields_))
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not items:
        raise ValueError(f"{path} has no texts")
    ids = [it.id for it in items]
    if len(set(ids)) != len(ids):
        dup = next(x for x in ids if ids.count(x) > 1)
        raise ValueError(f"{path}: id {dup!r} appears more than once")
    return items


def with_seed(items: list[Item], seed: int | None) -> list[Item]:
    """Items without a seed of their own take the job's (the same for every text), as ``synthesize``
    always gave every line its ``--seed``."""
    return [it if it.seed is not None or seed is None else replace(it, seed=seed) for it in items]


def item_params(base: SamplingParams, item: Item) -> SamplingParams:
    """The params one item is spoken with: the job's, with the item's seed, voice and options."""
    changes: dict[str, Any] = {}
    if item.seed is not None and item.seed != base.seed:
        changes["seed"] = item.seed
    if item.voice is not None:
        changes["speaker"] = item.voice
    if item.options:
        changes["options"] = {**(base.options or {}), **item.options}
    return replace(base, **changes) if changes else base


def shard(items: list[Item], num_shards: int) -> list[list[Item]]:
    """Split over ``num_shards`` workers: equal counts (within one), similar total text length (longest
    first, dealt round the workers), each shard in input order."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    order = sorted(range(len(items)), key=lambda i: (-len(items[i].text), i))
    picked: list[list[int]] = [[] for _ in range(num_shards)]
    for rank, i in enumerate(order):
        picked[rank % num_shards].append(i)
    return [[items[i] for i in sorted(p)] for p in picked]


def read_manifest(out_dir: str | Path) -> dict[str, ManifestEntry]:
    """The entries already written (the last one per id wins). Read as bytes, line by line: a torn last line (a
    crash mid-write, perhaps inside a multi-byte character) is skipped and reported, and so is any other line
    that does not parse, so one bad line never stops a resume."""
    path = Path(out_dir) / MANIFEST
    done: dict[str, ManifestEntry] = {}
    if not path.exists():
        return done
    *lines, tail = path.read_bytes().split(b"\n")
    if tail:
        logger.warning("%s: skipped a torn last line (%d bytes); its item will be redone", path, len(tail))
    for number, line in enumerate(lines, 1):
        try:
            entry = ManifestEntry(**json.loads(line.decode("utf-8")))
        except (UnicodeDecodeError, json.JSONDecodeError, TypeError):
            logger.warning("%s:%d: skipped a line that is not a manifest entry", path, number)
            continue
        done[entry.id] = entry
    return done


def pending(items: list[Item], out_dir: str | Path) -> list[Item]:
    """The items still to do: those without a successful manifest entry whose file exists."""
    out_dir = Path(out_dir)
    done = read_manifest(out_dir)
    return [
        it
        for it in items
        if not ((e := done.get(it.id)) and e.file and e.error is None and (out_dir / e.file).exists())
    ]


def write_wav_atomic(path: Path, audio, sample_rate: int) -> None:
    """The WAV appears whole or not at all (a resumed job never takes a torn file for a done one)."""
    from ..audio.wav import write_wav

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write_wav(tmp, audio, sample_rate)
    os.replace(tmp, path)


def append_manifest(out_dir: str | Path, entries: Iterable[ManifestEntry]) -> None:
    """Appends a batch's entries in one write, after cutting a torn last line (a crash mid-write) off: appended
    to the fragment, the first new entry would be glued to it and lost."""
    data = b"".join(e.to_json().encode("utf-8") + b"\n" for e in entries)
    path = Path(out_dir) / MANIFEST
    with open(path, "a+b") as f:
        _cut_torn_tail(f)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _cut_torn_tail(f) -> None:
    """Truncates ``f`` (open for reading and appending) after its last newline."""
    end = f.seek(0, os.SEEK_END)
    pos, block = end, 4096
    while pos > 0:
        start = max(0, pos - block)
        f.seek(start)
        newline = f.read(pos - start).rfind(b"\n")
        if newline >= 0:
            keep = start + newline + 1
            break
        pos = start
    else:
        keep = 0
    if keep < end:
        logger.warning("%s: cut a torn last line (%d bytes) before appending", f.name, end - keep)
        f.truncate(keep)
