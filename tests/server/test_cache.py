"""server/cache.py and its hooks in server/audio_response.py: which requests are cached, under which key, how
the cache stays within its bytes, and that a hit is the live answer byte for byte without the engine."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import sys
import tracemalloc
from contextlib import aclosing
from types import SimpleNamespace

import numpy as np
import pytest

from chattts_serve.audio.policy import StreamPolicy
from chattts_serve.engine.async_engine import EngineError
from chattts_serve.engine.outputs import RequestOutput, SegmentSpan
from chattts_serve.sampling_params import RefineParams, SamplingParams
from chattts_serve.server.audio_response import AudioResponse
from chattts_serve.server.cache import CACHE_HEADER, ResultCache, entry_bytes
from chattts_serve.server.errors import StreamFailed
from chattts_serve.server.limits import Limits
from chattts_serve.server.metrics import Metrics
from chattts_serve.text.lexicon import Lexicon

from .conftest import app_config, metric

POLICY = StreamPolicy()
SEEDED = SamplingParams(seed=7, refine_text=False)


def _key(cache: ResultCache, params=SEEDED, text="你好。", policy=POLICY, tenant=None):
    return cache.key(text, params, policy, tenant)


# ------------------------------------------------------------------------------------------------ the key


def test_only_seeded_requests_have_a_key():
    cache = ResultCache(1 << 20)
    assert _key(cache, SamplingParams()) is None
    assert _key(cache, SamplingParams(refine=RefineParams(seed=3))) is None  # refine only
    assert _key(cache, SEEDED) is not None


def test_equal_requests_have_one_key_and_any_difference_another():
    cache = ResultCache(1 << 20)
    base = _key(cache)
    assert _key(cache, SamplingParams(seed=7, refine_text=False)) == base  # built again: the same key
    variants = [
        _key(cache, text="你好!"),
        _key(cache, SamplingParams(seed=8, refine_text=False)),
        _key(cache, SamplingParams(seed=7, refine_text=True)),
        _key(cache, SamplingParams(seed=7, refine_text=False, temperature=0.31)),
        _key(cache, SamplingParams(seed=7, refine_text=False, temperature=(0.3, 0.3, 0.3, 0.4))),
        _key(cache, SamplingParams(seed=7, refine_text=False, speaker="蘁淰")),
        _key(cache, SamplingParams(seed=7, refine_text=False, speaker_sample="x")),
        _key(cache, SamplingParams(seed=7, refine_text=False, speaker_sample="x", speaker_sample_text="t")),
        _key(cache, SamplingParams(seed=7, refine_text=False, lexicon=Lexicon({"长": "chang2"}))),
        _key(cache, SamplingParams(seed=7, refine_text=False, lexicon=Lexicon({"长": "zhang3"}))),
        _key(cache, policy=StreamPolicy(first_chunk=8)),
        _key(cache, tenant="a"),
        _key(cache, tenant="b"),
        _key(ResultCache(1 << 20, identity="another model")),
    ]
    assert None not in variants and len({base, *variants}) == len(variants) + 1


def test_a_lexicon_is_keyed_by_its_entries():
    cache = ResultCache(1 << 20)

    def with_lexicon(lex):
        return _key(cache, SamplingParams(seed=7, lexicon=lex))

    assert with_lexicon(Lexicon({"长": "chang2", "行": "hang2"})) == with_lexicon(
        Lexicon({"行": "hang2", "长": "chang2"})
    )
    server = Lexicon({"行": "hang2"})
    assert with_lexicon(Lexicon({"长": "chang2"}, base=server)) != with_lexicon(Lexicon({"长": "chang2"}))


# ------------------------------------------------------------------------------------------------ LRU


def _outputs(samples: int) -> list[RequestOutput]:
    half = samples // 2
    return [
        RequestOutput("r", np.ones(half, np.float32)),
        RequestOutput("r", np.ones(samples - half, np.float32), finished=True, finish_reason="stop"),
    ]


def test_the_least_recently_used_entries_go_when_the_bytes_run_out():
    size = entry_bytes(_outputs(1000)) + sys.getsizeof("a")  # the outputs and the key
    cache = ResultCache(4 * size + size // 2)  # room for four
    for key in "abcd":
        assert cache.put(key, _outputs(1000))
    assert cache.get("a") is not None  # a is now the most recently used: b goes first
    cache.put("e", _outputs(1000))
    assert cache.get("b") is None and all(cache.get(k) is not None for k in "acde")
    assert cache.nbytes == 4 * size and len(cache) == 4
    cache.put("c", _outputs(1000))  # stored again: counted once
    assert cache.nbytes == 4 * size and len(cache) == 4


def test_a_result_larger_than_a_quarter_of_the_cache_is_not_kept():
    cache = ResultCache(4 * entry_bytes(_outputs(1000)) - 1)
    assert not cache.put("big", _outputs(1000))
    assert cache.get("big") is None and cache.nbytes == 0


@pytest.mark.parametrize(
    ("count", "audio_bytes", "max_bytes"),
    [(10_000, 1 << 10, 8 << 20), (100, 10 << 20, 64 << 20)],
    ids=["10000x1KB", "100x10MB"],
)
def test_the_bound_holds_in_the_bytes_entries_really_hold(count, audio_bytes, max_bytes):
    """``--cache-mb`` bounds what the entries really hold (tracemalloc: arrays, output objects, keys, the
    dict), for many small entries as for a few large ones (issue 29, item 11): an entry counts at least what
    it holds, so the cache never holds more than its bound, and not much less."""
    half = audio_bytes // 8  # two float32 chunks

    def put(into: ResultCache, i: int) -> bool:
        outputs = [
            RequestOutput(f"req-{i}", np.ones(half, np.float32), spans=[SegmentSpan(0, "你好。", 0, half, 24000)]),
            RequestOutput(f"req-{i}", np.ones(half, np.float32), finished=True, finish_reason="stop"),
        ]
        return into.put(hashlib.sha256(str(i).encode()).hexdigest(), outputs)

    cache = ResultCache(max_bytes)
    tracemalloc.start()
    try:
        assert put(ResultCache(max_bytes), -1)  # the first use's one-off allocations are not the cache's
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        for i in range(count):
            assert put(cache, i)
            assert cache.nbytes <= cache.max_bytes
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(cache) < count  # it was full: entries went
    assert held <= max_bytes and cache.nbytes <= max_bytes, (held, cache.nbytes)
    # Each entry counts at least what it holds; the slack is the interpreter's and numpy's free lists, which
    # the first few hundred arrays fill (a few KB once, not per entry).
    assert held <= cache.nbytes + (16 << 10), (held, cache.nbytes)
    assert cache.nbytes <= 1.25 * held  # and the count is close to the truth


def test_a_view_counts_the_buffer_it_keeps_alive():
    whole = np.ones(100_000, np.float32)
    assert entry_bytes([RequestOutput("r", whole[:10])]) > whole.nbytes


def test_stored_audio_is_read_only():
    cache = ResultCache(1 << 20)
    cache.put("k", _outputs(100))
    with pytest.raises(ValueError):
        cache.get("k")[0].audio[0] = 0.5


# -------------------------------------------------------------------- AudioResponse over a scripted engine


class ScriptedEngine:
    """An engine whose stream yields the given outputs, then raises ``fail`` (if any); counts its requests."""

    sample_rate = 24000

    def __init__(self, outputs, fail: BaseException | None = None) -> None:
        self.outputs, self.fail, self.calls = outputs, fail, 0

    async def stream(self, text, params, *, request_id, policy):
        self.calls += 1
        for out in self.outputs:
            yield out
        if self.fail is not None:
            raise self.fail


def _http_request(cache: ResultCache, tenant: str | None = None):
    """What ``AudioResponse`` reads of an HTTP request: the app's cache, the scope (tenant), disconnection."""
    state = {"auth": SimpleNamespace(tenant=tenant, owner=tenant)} if tenant is not None else {}

    async def is_disconnected():
        return False

    return SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(cache=cache)), scope={"state": state},
                           is_disconnected=is_disconnected)  # fmt: skip


def _run(engine, cache, *, read: int | None = None, params=SEEDED, tenant=None):
    """One request through ``AudioResponse``; ``read``: stop after that many chunks (the client left).
    Returns the response (its ``cache_status``) and the chunks read."""

    async def main():
        resp = AudioResponse(engine, Metrics(), Limits(4), "tts", 5.0)
        await resp.start("你好。", params, POLICY, "rid", _http_request(cache, tenant))
        got = []
        async with aclosing(resp.chunks()) as chunks:
            async for chunk in chunks:
                got.append(chunk)
                if read is not None and len(got) == read:
                    break
        return resp, got

    return asyncio.run(main())


def _script(n: int = 3, reason: str = "stop") -> list[RequestOutput]:
    outs = [RequestOutput("live", np.full(100 * (i + 1), i, np.float32)) for i in range(n - 1)]
    return [*outs, RequestOutput("live", np.zeros(7, np.float32), finished=True, finish_reason=reason, num_steps=5)]


def test_a_hit_replays_the_live_chunks_without_the_engine():
    cache, engine = ResultCache(1 << 20), ScriptedEngine(_script())
    miss, live = _run(engine, cache)
    hit, replayed = _run(engine, cache)
    assert (miss.cache_status, hit.cache_status, engine.calls) == ("miss", "hit", 1)
    assert hit.headers[CACHE_HEADER] == "hit" and miss.headers[CACHE_HEADER] == "miss"
    assert [len(c.audio) for c in replayed] == [len(c.audio) for c in live]  # the live chunking
    assert all(np.array_equal(a.audio, b.audio) for a, b in zip(live, replayed, strict=True))
    assert replayed[-1].finished and replayed[-1].num_steps == 5 and replayed[-1].request_id == "rid"


def test_unseeded_requests_are_never_looked_up():
    cache, engine = ResultCache(1 << 20), ScriptedEngine(_script())
    for _ in range(2):
        resp, _ = _run(engine, cache, params=SamplingParams())
        assert resp.cache_status is None and CACHE_HEADER not in resp.headers
    assert engine.calls == 2 and len(cache) == 0


@pytest.mark.parametrize("reason", ["stop", "length"])
def test_complete_results_are_kept_empty_audio_included(reason):
    cache = ResultCache(1 << 20)
    _run(ScriptedEngine([RequestOutput("live", np.zeros(0, np.float32), True, reason)]), cache)
    assert len(cache) == 1


def test_an_aborted_stream_is_not_kept():
    cache, engine = ResultCache(1 << 20), ScriptedEngine(_script())
    _run(engine, cache, read=1)
    assert len(cache) == 0
    assert _run(engine, cache)[0].cache_status == "miss"


def test_a_failed_stream_is_not_kept():
    cache = ResultCache(1 << 20)
    with pytest.raises(StreamFailed):
        _run(ScriptedEngine(_script()[:-1], fail=EngineError("boom")), cache)
    assert len(cache) == 0


def test_tenants_do_not_share_entries():
    cache, engine = ResultCache(1 << 20), ScriptedEngine(_script())
    assert _run(engine, cache, tenant="a")[0].cache_status == "miss"
    assert _run(engine, cache, tenant="b")[0].cache_status == "miss"
    assert _run(engine, cache, tenant="a")[0].cache_status == "hit"


# -------------------------------------------------------------------------------------- through the app


@pytest.fixture(scope="module")
def client(tiny_ckpt, tmp_path_factory):
    """The app in process on its own engine, with tenants "a" and "b" (keys ka, kb) and a 1 MiB cache."""
    from starlette.testclient import TestClient

    from chattts_serve.engine.async_engine import AsyncEngine
    from chattts_serve.engine.config import EngineConfig
    from chattts_serve.server.app import create_app
    from chattts_serve.server.auth import KeyRing

    config = app_config(tiny_ckpt, tmp_path_factory.mktemp("cache"), cache_mb=1)
    engine = AsyncEngine.from_pretrained(tiny_ckpt, "cpu", EngineConfig.with_slots(2))
    keys = KeyRing.from_tenants({"a": ("ka",), "b": ("kb",)})
    with TestClient(create_app(config, engine=engine, keys=keys)) as c:
        yield c


A, B = {"Authorization": "Bearer ka"}, {"Authorization": "Bearer kb"}


def _count(client, name: str) -> float:
    return metric("", name, text=client.get("/metrics", headers=A).text)


def _tts(client, headers=A, **body):
    body = {"text": "今天天气真不错。", "format": "pcm", "refine_text": False, "max_new_tokens": 12, **body}
    r = client.post("/v1/tts", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("fmt", ["wav", "mp3", "flac"])
def test_a_seeded_request_again_is_a_byte_identical_hit(client, fmt, stream):
    hits, misses = _count(client, "chattts_cache_hits_total"), _count(client, "chattts_cache_misses_total")
    seed = 100 + ["wav", "mp3", "flac"].index(fmt) + 10 * stream
    first = _tts(client, seed=seed, format=fmt, stream=stream)
    again = _tts(client, seed=seed, format=fmt, stream=stream)
    assert (first.headers[CACHE_HEADER], again.headers[CACHE_HEADER]) == ("miss", "hit")
    assert again.content == first.content and len(first.content) > 0
    assert _count(client, "chattts_cache_hits_total") == hits + 1
    assert _count(client, "chattts_cache_misses_total") == misses + 1
    assert _count(client, "chattts_cache_bytes") > 0


def test_one_entry_serves_every_format_and_rate(client):
    """The entry is the PCM in its live chunks: the same request in another format or at another rate is a hit."""
    assert _tts(client, seed=200).headers[CACHE_HEADER] == "miss"
    assert _tts(client, seed=200, format="opus").headers[CACHE_HEADER] == "hit"
    assert _tts(client, seed=200, format="wav", sample_rate=8000).headers[CACHE_HEADER] == "hit"


def test_unseeded_requests_have_no_cache_header(client):
    for _ in range(2):
        assert CACHE_HEADER not in _tts(client).headers


@pytest.mark.parametrize(
    "change",
    [{"seed": 301}, {"voice": "alloy"}, {"temperature": 0.5}, {"text": "今天天气不错。"}, {"prompt": "[speed_3]"}],
)
def test_another_option_or_voice_is_a_miss(client, change):
    _tts(client, seed=300)
    assert _tts(client, **{"seed": 300, **change}).headers[CACHE_HEADER] == "miss"


def test_each_tenant_has_its_own_entries(client):
    assert _tts(client, A, seed=400).headers[CACHE_HEADER] == "miss"
    assert _tts(client, B, seed=400).headers[CACHE_HEADER] == "miss"
    assert _tts(client, B, seed=400).headers[CACHE_HEADER] == "hit"


def test_openai_speech_and_its_sse_are_cached(client):
    body = {"model": "tts-1", "voice": "alloy", "input": "今天天气真不错。", "response_format": "pcm",
            "seed": 500, "refine_text": False, "max_new_tokens": 12}  # fmt: skip
    first = client.post("/v1/audio/speech", json=body, headers=A)
    again = client.post("/v1/audio/speech", json=body, headers=A)
    assert (first.headers[CACHE_HEADER], again.headers[CACHE_HEADER]) == ("miss", "hit")
    assert again.content == first.content
    sse = client.post("/v1/audio/speech", json={**body, "stream_format": "sse"}, headers=A)
    assert sse.headers[CACHE_HEADER] == "hit" and "speech.audio.done" in sse.text


def test_cache_mb_zero_turns_the_cache_off_and_a_negative_size_is_refused():
    from chattts_serve.server.config import ServerConfig

    assert ResultCache.for_engine(None, 0) is None
    with pytest.raises(ValueError, match="cache_mb"):
        ServerConfig.from_flat(cache_mb=-1)
