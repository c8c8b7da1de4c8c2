"""The result cache: a deterministic request's audio, kept so that the same request again is answered without
the engine (``ServerConfig.cache_mb``; 0 turns it off).

What is cached. A request whose audio is a pure function of the request: its ``SamplingParams`` has a seed
(the refine pass then has one too: its own or the request's, ``SamplingParams.refine_seed``). Unseeded
requests draw from the global RNG; they are never cached. Only a request that ran to its end ("stop" or
"length", empty audio included) is kept; an aborted or failed one never. Where the engine is not batch
invariant (the CUDA static step, int8-dynamic, ort-int8, ort-auto: README, "Determinism"), a seeded request's
last bits may depend on what ran beside it; a hit then gives the first run's answer, every time.

The key: sha256 over everything that changes the audio's bits. The text; every ``SamplingParams`` field
(the resolved speaker string and voice sample, the lexicon's entries: a field this module cannot spell
exactly makes the request uncacheable rather than mistaken); the chunking (``StreamPolicy``: the joins'
crossfades follow it); the tenant (``params.tenant_of``: no tenant learns from a fast answer what another
asked for); and the engine (``engine_identity``: the model family, its checkpoint's files, precision, KV and
audio dtypes, slots, device). Format and sample rate are not in it: an entry is the request's PCM in the chunks
its live stream had, and a hit replays them through the same encoder, so one entry serves every format and transport of
``AudioResponse`` (``/v1/tts`` streamed or whole, ``/v1/audio/speech``, its SSE), byte for byte as the live
answer, and streamed in the live answer's chunks.

A hit still counts as a request in flight (``max_concurrent_streams``: it holds a connection and an
encoder) and in the request metrics, but not in the real-time factor or audio seconds (the engine made
nothing). Not cached: WebSocket and Wyoming sessions (their requests have no HTTP scope, hence no tenant, and a
session's parts take their voice from its first part).

Memory: an LRU bounded in bytes (float32 PCM, 94 KB per second of audio: 256 MB hold about 45 minutes). An
entry counts what it really holds (``entry_bytes``): its arrays' buffers, and the Python objects around them
and its key, so that many small entries hold the bound as a few large ones do (tests/server/test_cache.py
measures both with tracemalloc). The server is asyncio and the cache is used only on its event loop, so the
``OrderedDict`` needs no lock.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import numpy as np

from ..audio.policy import StreamPolicy
from ..engine.outputs import RequestOutput
from ..sampling_params import SamplingParams
from ..text.lexicon import Lexicon

CACHE_HEADER = "X-Cache"
"""``hit`` or ``miss`` on a response whose request the cache looked up; absent when it is not cacheable."""
KEY_VERSION = 1
"""Bump when what a key covers changes."""
_LEXICON_MEMO_SIZE = 16
_ENTRY_OVERHEAD = 256
"""Bytes counted per entry beyond the objects ``entry_bytes`` sizes: the ``OrderedDict``'s node and its share
of the table (CPython: ~100 B at the fullest), and the (outputs, size) pair."""


class ResultCache:
    """Completed results by request key, least recently used evicted first, at most ``max_bytes`` in all."""

    def __init__(self, max_bytes: int, identity: str = "") -> None:
        """``identity``: what of the engine decides a result's bits (``engine_identity``), in every key."""
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.max_bytes = max_bytes
        self.identity = identity
        self.nbytes = 0
        """Bytes the entries hold (``entry_bytes`` of each)."""
        self._entries: OrderedDict[str, tuple[tuple[RequestOutput, ...], int]] = OrderedDict()

    @classmethod
    def for_engine(cls, engine, max_mb: int) -> ResultCache | None:
        """The cache of a server on ``engine`` (an ``AsyncEngine``); None when ``max_mb`` is 0 (no cache)."""
        return cls(max_mb << 20, engine_identity(engine)) if max_mb > 0 else None

    @property
    def max_entry_bytes(self) -> int:
        """The largest result kept: a quarter of the cache, so that one long result does not flush it."""
        return max(1, self.max_bytes // 4)

    def __len__(self) -> int:
        return len(self._entries)

    def key(
        self, text: str, params: SamplingParams, policy: StreamPolicy, tenant: str | None, budget: float | None = None
    ) -> str | None:
        """The request's key; None when it is not cacheable (no seed, or an option it cannot spell). ``budget``:
        the request's audio budget when tighter than the engine's (it caps the audio: ``server.budget``)."""
        if params.seed is None or params.refine_seed is None:
            return None
        try:
            doc = [KEY_VERSION, self.identity, tenant, text, _plain(params), _plain(policy)]
            if budget is not None:
                doc.append(budget)
            raw = json.dumps(doc, ensure_ascii=False, separators=(",", ":"))
        except TypeError:
            return None
        return hashlib.sha256(raw.encode()).hexdigest()

    def get(self, key: str) -> tuple[RequestOutput, ...] | None:
        """The outputs stored for ``key``, as the live request streamed them (now the most recently used)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: str, outputs: Sequence[RequestOutput]) -> bool:
        """Keep a completed request's outputs (the last one finished), evicting the least recently used
        entries to stay within ``max_bytes``. False (nothing kept) when it is larger than ``max_entry_bytes``."""
        size = entry_bytes(outputs) + sys.getsizeof(key)
        if size > self.max_entry_bytes:
            return False
        for out in outputs:  # shared with every later hit: nobody may change them in place
            out.audio.flags.writeable = False
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= old[1]
        self._entries[key] = (tuple(outputs), size)
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.nbytes -= evicted
        return True


def entry_bytes(outputs: Sequence[RequestOutput]) -> int:
    """What an entry of ``outputs`` holds, its key aside: each output object, its audio (the whole buffer a
    view keeps alive), its strings and its sentences (spans; the last one's segments with their codes), and
    the tuple that holds them. Shared objects (one request id for every output) are counted for each: the
    count errs high, never low."""
    size = _ENTRY_OVERHEAD + sys.getsizeof(tuple(outputs))
    for out in outputs:
        size += sys.getsizeof(out) + _array_bytes(out.audio) + sys.getsizeof(out.request_id)
        size += sys.getsizeof(out.voice_sample) + sys.getsizeof(out.error)
        size += sys.getsizeof(out.spans) + sum(sys.getsizeof(s) + sys.getsizeof(s.text) for s in out.spans)
        for seg in out.segments or ():
            size += sys.getsizeof(seg) + _array_bytes(seg.codes) + sys.getsizeof(seg.text) + 64
    return size


def _array_bytes(array: np.ndarray) -> int:
    """An array's object and the buffer it keeps alive: a view's base, whole (``getsizeof`` counts the
    buffer of an array that owns its data, and only the header of any other)."""
    root = array
    while isinstance(root.base, np.ndarray):
        root = root.base
    return sys.getsizeof(array) + (0 if root is array and root.flags.owndata else root.nbytes)


def engine_identity(engine) -> str:
    """What of a server's engine (an ``AsyncEngine``) decides a seeded request's bits: its model family and
    checkpoint (``FamilyModel.identity``: path, and each file's size and modification time: hashing gigabytes at
    start-up would buy nothing for a cache that lives as long as the process), its whole ``EngineConfig``
    (precision, KV cache and audio dtypes, slots, decode step) and its device."""
    inner = engine.engine
    checkpoint = inner.family_model.identity()
    return json.dumps([inner.family.name, checkpoint, repr(inner.config), str(inner.device)])


def _plain(value):
    """``value`` as JSON data that tells every distinct value apart; TypeError for a type it cannot spell."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, Lexicon):
        return {"lexicon": _lexicon_digest(value)}
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("cannot key a mapping whose keys are not strings")
        return {"mapping": [[k, _plain(value[k])] for k in sorted(value)]}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"type": type(value).__name__, **fields}
    raise TypeError(f"cannot key a {type(value).__name__}")


_lexicon_digests: OrderedDict[int, tuple[Lexicon, str]] = OrderedDict()


def _lexicon_digest(lexicon: Lexicon) -> str:
    """sha256 of a lexicon's entries over its base's (a request's over the server's). A server lexicon may hold
    thousands of entries and is the same object for every request, so digests are kept per object (Lexicons
    are immutable; the memo holds the object, so its id is not reused while remembered)."""
    memo = _lexicon_digests.get(id(lexicon))
    if memo is not None and memo[0] is lexicon:
        _lexicon_digests.move_to_end(id(lexicon))  # the server's, under every request's: it stays
        return memo[1]
    base = _lexicon_digest(lexicon.base) if lexicon.base is not None else None
    raw = json.dumps([base, sorted(lexicon.entries.items())], ensure_ascii=False, separators=(",", ":"))
    digest = hashlib.sha256(raw.encode()).hexdigest()
    _lexicon_digests[id(lexicon)] = (lexicon, digest)
    while len(_lexicon_digests) > _LEXICON_MEMO_SIZE:
        _lexicon_digests.popitem(last=False)
    return digest
