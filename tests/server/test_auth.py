"""API keys (``--api-keys k1,k2``): every endpoint but /health (and the static playground page) needs one."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai import OpenAI
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from .conftest import HTTP_TIMEOUT, check_openai_error, expected_samples, running_server, start_server

TEXT = "你好。"
FIXED = {"seed": 1, "refine_text": False, "min_new_tokens": 8, "max_new_tokens": 8}
SPEECH = {"model": "tts-1", "voice": "alloy", "input": TEXT, "response_format": "pcm", **FIXED}
TTS = {"text": TEXT, "format": "pcm", **FIXED}

# (method, path, json body, status with a valid key)
PROTECTED = [
    ("GET", "/v1/models", None, 200),
    ("POST", "/v1/audio/speech", SPEECH, 200),
    ("POST", "/v1/tts", TTS, 200),
    ("GET", "/v1/voices", None, 200),
    ("GET", "/v1/voices/nobody", None, 404),
    ("DELETE", "/v1/voices/nobody", None, 404),
    ("GET", "/metrics", None, 200),
    ("GET", "/ready", None, 200),
]
IDS = [f"{m} {p}" for m, p, _, _ in PROTECTED]


@pytest.fixture(scope="module")
def auth_server(tiny_ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth")
    with running_server(tiny_ckpt, tmp, "--api-keys", "k1,k2", "--no-warmup", in_process=True) as base:
        yield base


@pytest.fixture(scope="module")
def http(auth_server):
    with httpx.Client(base_url=auth_server, timeout=HTTP_TIMEOUT) as c:
        yield c


def test_health_and_page_are_public(http):
    r = http.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    r = http.get("/")
    assert r.status_code == 200 and "<audio" in r.text


@pytest.mark.parametrize("method,path,body,ok", PROTECTED, ids=IDS)
def test_protected_endpoints(http, method, path, body, ok):
    bad_headers = (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "k1"},
        {"Authorization": "Bearer"},
        {"Authorization": "Bearer k1x"},
        {"X-API-Key": "k1"},
    )
    for headers in bad_headers:
        r = http.request(method, path, json=body, headers=headers)
        err = check_openai_error(r, 401)
        assert err["type"] == "authentication_error"
        assert r.headers.get("x-request-id")
    for key in ("k1", "k2"):
        r = http.request(method, path, json=body, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == ok, r.text
        if path in ("/v1/audio/speech", "/v1/tts"):
            assert len(r.content) == 2 * expected_samples(8)
    # The query form is for the WebSocket only: over HTTP a key in the URL would end up in logs.
    check_openai_error(http.request(method, path, params={"api_key": "k2"}, json=body), 401)


def test_voice_crud_needs_key(http):
    check_openai_error(http.post("/v1/voices", json={"name": "a", "seed": 1}), 401)
    r = http.post("/v1/voices", json={"name": "a", "seed": 1}, headers={"Authorization": "Bearer k2"})
    assert r.status_code == 201
    check_openai_error(http.delete("/v1/voices/a"), 401)
    assert http.delete("/v1/voices/a", headers={"Authorization": "Bearer k1"}).status_code == 404  # k2's voice
    assert http.delete("/v1/voices/a", headers={"Authorization": "Bearer k2"}).status_code == 200


def test_openai_sdk_with_key(auth_server):
    with OpenAI(base_url=f"{auth_server}/v1", api_key="k1", timeout=60, max_retries=0) as client:
        assert "tts-1" in [m.id for m in client.models.list()]
        audio = client.audio.speech.create(
            model="tts-1", voice="alloy", input=TEXT, response_format="pcm", extra_body=FIXED
        ).content
        assert len(audio) == 2 * expected_samples(8)
    with OpenAI(base_url=f"{auth_server}/v1", api_key="nope", timeout=60, max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
        with pytest.raises(openai.AuthenticationError):
            client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, extra_body=FIXED)


def _ws_run(url: str, headers: dict[str, str] | None = None) -> tuple[list[dict], int | None]:
    events = []
    with connect(url, additional_headers=headers, open_timeout=10, close_timeout=5) as ws:
        try:  # a refused connection gets its error event and close right away: sending may fail then
            ws.send(json.dumps({"type": "start", "format": "pcm", **FIXED}))
        except ConnectionClosed:
            pass
        try:
            events.append(json.loads(ws.recv(timeout=HTTP_TIMEOUT)))
            if events[0]["type"] == "start":
                ws.send(json.dumps({"type": "text", "text": TEXT}))
                ws.send(json.dumps({"type": "end"}))
            while True:
                msg = ws.recv(timeout=HTTP_TIMEOUT)
                if isinstance(msg, str):
                    events.append(json.loads(msg))
        except ConnectionClosed:
            pass
        return events, ws.close_code


def test_websocket_needs_key(auth_server):
    url = auth_server.replace("http://", "ws://") + "/v1/tts/stream"
    for bad_url, headers in ((url, None), (url + "?api_key=wrong", None), (url, {"Authorization": "Bearer wrong"})):
        events, code = _ws_run(bad_url, headers)
        assert events and events[0]["type"] == "error" and "key" in events[0]["message"]
        assert code == 1008
        assert not any(e["type"] == "chunk" for e in events)
    for good_url, headers in ((url + "?api_key=k1", None), (url, {"Authorization": "Bearer k2"})):
        events, code = _ws_run(good_url, headers)
        assert [e["type"] for e in events][0] == "start" and events[-1]["type"] == "end", events
        assert sum(e["samples"] for e in events if e["type"] == "chunk") == expected_samples(8)
        assert code == 1000


@pytest.mark.integration
def test_keys_never_reach_the_log(tiny_ckpt, tmp_path):
    key = "sekret-key-5e1f"
    with start_server(tiny_ckpt, tmp_path, "--api-keys", key, "--no-warmup", "--log-level", "info") as srv:
        url = srv.base.replace("http://", "ws://") + "/v1/tts/stream"
        events, code = _ws_run(f"{url}?api_key={key}")
        assert events[-1]["type"] == "end" and code == 1000
        with httpx.Client(base_url=srv.base, timeout=HTTP_TIMEOUT) as c:
            check_openai_error(c.get("/v1/models", params={"api_key": key}), 401)
            assert c.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        log = srv.log()
    assert "/v1/models" in log  # requests are logged ...
    assert key not in log  # ... but never a key


# ------------------------------------------------------------------ one key parser (server/auth.py), in process
# The app in this process (TestClient: HTTP and WebSocket scopes without sockets), keys "k1" and "k2".


def _scope(kind: str, headers: list[tuple[str, str]] = (), query: str = "") -> dict:
    raw = [(n.lower().encode("latin-1"), v.encode("latin-1")) for n, v in headers]
    return {"type": kind, "headers": raw, "query_string": query.encode("latin-1")}


BASIC = ("Authorization", "Basic eDp5")


@pytest.mark.parametrize(
    ("kind", "headers", "query", "key", "ambiguous"),
    [
        ("http", [("Authorization", "Bearer k1")], "", "k1", False),
        ("http", [("Authorization", "bearer  k1 ")], "", "k1", False),
        ("http", [], "api_key=k1", None, False),  # over HTTP a key in the URL counts for nothing
        ("http", [BASIC], "api_key=k1", None, False),
        ("http", [("Authorization", "Bearer k1")], "api_key=k1", "k1", False),
        ("websocket", [], "api_key=k1", "k1", False),
        ("websocket", [BASIC], "api_key=k1", "k1", False),  # a Basic header names no key of ours
        ("websocket", [("Authorization", "Bearer k1")], "api_key=k1", "k1", False),
        ("http", [BASIC, ("Authorization", "Bearer k1")], "", None, True),
        ("http", [("Authorization", "Bearer k1"), ("Authorization", "Bearer k1")], "", None, True),
        ("websocket", [BASIC, ("Authorization", "Bearer junk")], "api_key=k1", None, True),
        ("websocket", [("Authorization", "Basic eDp5, Bearer junk")], "api_key=k1", None, True),  # folded
        ("websocket", [], "api_key=junk&api_key=k1", None, True),
        ("websocket", [], "api_key=k1&api_key=k1", None, True),
        ("websocket", [], "api_key=junk&api_k%65y=k1", None, True),  # the name is compared decoded
        ("http", [("Authorization", "Bearer k1")], "api_key=k1&api_key=k1", None, True),
        ("http", [("Authorization", "Bearer k1")], "api_key=k2", None, True),
        ("websocket", [("Authorization", "Bearer junk")], "api_key=k1", None, True),
    ],
)
def test_read_key(kind, headers, query, key, ambiguous):
    from chattts_serve.server.auth import read_key

    got, problem = read_key(_scope(kind, headers, query))
    assert got == key and bool(problem) == ambiguous, (got, problem)
    assert "k1" not in problem and "junk" not in problem  # a refusal never quotes a key


def test_resolve_with_keys_and_with_tenants():
    from chattts_serve.server.auth import KeyRing, Principal, key_owner, resolve

    bearer = _scope("http", [("Authorization", "Bearer k1")])
    assert resolve(bearer, KeyRing()) == Principal(True, True)  # no keys: nothing is refused
    assert resolve(_scope("http", [BASIC, BASIC]), KeyRing()).authorized
    plain = KeyRing.from_keys(("k1", "k2"))
    assert resolve(bearer, plain) == Principal(True, True, None, key_owner("k1"))  # a plain key is its own
    assert key_owner("k1") != key_owner("k2") and "k1" not in key_owner("k1")
    assert resolve(bearer, KeyRing.from_keys(("k1", "k2"), shared=True)) == Principal(True, True, None, None)
    assert resolve(_scope("http"), plain) == Principal(False, False, problem="missing or invalid API key")
    assert not resolve(_scope("websocket", query="api_key=k3"), plain).authorized
    tenants = KeyRing.from_tenants({"a": ("k1",), "b": ("k2", "k3")})
    assert resolve(_scope("websocket", query="api_key=k3"), tenants) == Principal(True, True, "b", "b")
    assert resolve(bearer, tenants).tenant == "a"
    assert not resolve(_scope("http", [("Authorization", "Bearer k4")]), tenants).authorized
    assert not resolve(bearer, KeyRing.from_tenants({})).authorized  # tenants, none served: every key refused


# ------------------------------------------------------------------ principals: whose cache, whose voices


def _as(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


SECRET = {
    "text": "我的银行卡密码是七三九一。",
    "format": "pcm",
    "seed": 42,
    **{k: v for k, v in FIXED.items() if k != "seed"},
}


@pytest.mark.parametrize("shared", [False, True], ids=["own", "shared"])
def test_each_plain_key_is_its_own_principal(tiny_ckpt, tmp_path, shared):
    """With ``--api-keys k1,k2`` a key never sees another's cache entries (no ``X-Cache: hit``, a real
    synthesis: the cache must not tell k2 what k1 asked) nor its saved voices (issue 29, item 6); keys the
    operator declares one principal (``--api-keys-shared``) share both."""
    flags = ["--api-keys", "k1,k2", "--cache-mb", "16", "--no-warmup", *(["--api-keys-shared"] if shared else [])]
    with (
        running_server(tiny_ckpt, tmp_path, *flags, in_process=True) as base,
        httpx.Client(base_url=base, timeout=HTTP_TIMEOUT) as http,
    ):
        first = http.post("/v1/tts", json=SECRET, headers=_as("k1"))
        assert first.status_code == 200 and first.headers["X-Cache"] == "miss"
        assert http.post("/v1/tts", json=SECRET, headers=_as("k1")).headers["X-Cache"] == "hit"  # its own
        before = _synthesised(http)
        guess = http.post("/v1/tts", json=SECRET, headers=_as("k2"))
        assert guess.status_code == 200 and guess.content == first.content  # same request, same audio
        assert guess.headers["X-Cache"] == ("hit" if shared else "miss")
        assert (_synthesised(http) > before) is not shared  # a miss is a real run: no timing tells
        assert http.post("/v1/tts", json=SECRET, headers=_as("k2")).headers["X-Cache"] == "hit"  # now its own

        assert http.post("/v1/voices", json={"name": "k2-voice", "seed": 7}, headers=_as("k2")).status_code == 201
        listed = [v["name"] for v in http.get("/v1/voices", headers=_as("k1")).json()["data"]]
        assert ("k2-voice" in listed) is shared
        if not shared:
            assert http.get("/v1/voices/k2-voice", headers=_as("k1")).status_code == 404
            assert http.delete("/v1/voices/k2-voice", headers=_as("k1")).status_code == 404
            check_openai_error(http.post("/v1/tts", json={**TTS, "voice": "k2-voice"}, headers=_as("k1")), 400)
            # each key may have a voice of the same name
            assert http.post("/v1/voices", json={"name": "k2-voice", "seed": 8}, headers=_as("k1")).status_code == 201
        assert http.get("/v1/voices/k2-voice", headers=_as("k2")).json()["name"] == "k2-voice"  # still k2's
        assert http.delete("/v1/voices/k2-voice", headers=_as("k2")).status_code == 200


def _synthesised(http) -> float:
    """Seconds of audio the engine made so far (``/metrics``): a cache hit adds none."""
    text = http.get("/metrics", headers=_as("k1")).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("chattts_audio_seconds_total"))


@pytest.fixture(scope="module")
def local(tiny_ckpt, tmp_path_factory):
    from fastapi.testclient import TestClient

    from chattts_serve.server.app import create_app
    from chattts_serve.server.config import ServerConfig

    db = tmp_path_factory.mktemp("auth-inproc") / "voices.sqlite3"
    config = ServerConfig.from_flat(
        model=str(tiny_ckpt), device="cpu", voices_db=str(db), warmup=False, api_keys=("k1", "k2")
    )
    with TestClient(create_app(config)) as client:
        yield client


# (headers, query, status of GET /v1/models)
HTTP_CASES = [
    ([("Authorization", "Bearer k1")], "", 200),
    ([("Authorization", "Bearer k1")], "api_key=k1", 200),  # the same key twice says one thing
    ([], "api_key=k1", 401),
    ([BASIC], "api_key=k1", 401),
    ([BASIC, ("Authorization", "Bearer k1")], "", 401),
    ([("Authorization", "Bearer k1"), ("Authorization", "Bearer k1")], "", 401),
    ([("Authorization", "Bearer junk")], "api_key=k1", 401),
    ([("Authorization", "Bearer k1")], "api_key=k2", 401),  # two good keys that disagree
    ([("Authorization", "Bearer k1")], "api_key=junk&api_key=k1", 401),
    ([("Authorization", "Bearer k3")], "", 401),
]


@pytest.mark.parametrize(("headers", "query", "status"), HTTP_CASES)
def test_http_key_rules(local, headers, query, status):
    r = local.get("/v1/models?" + query, headers=httpx.Headers(headers))
    if status == 200:
        assert r.status_code == 200, r.text
        return
    err = check_openai_error(r, 401)
    assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
    assert "k1" not in err["message"] and "junk" not in err["message"]
    assert r.headers.get("x-request-id")


def test_public_paths_ignore_credentials(local):
    both = httpx.Headers([BASIC, ("Authorization", "Bearer junk")])
    assert local.get("/health?api_key=a&api_key=b", headers=both).status_code == 200


def _ws_open(client, query: str, headers: list[tuple[str, str]]) -> tuple[list[dict], int]:
    """Start a session (no text), end it; (events, close code)."""
    events = []
    with client.websocket_connect("/v1/tts/stream?" + query, headers=httpx.Headers(headers)) as ws:
        ws.send_json({"type": "start", "format": "pcm", **FIXED})
        while True:
            msg = ws.receive()
            if msg["type"] == "websocket.close":
                return events, msg["code"]
            if msg.get("text") is not None:
                events.append(json.loads(msg["text"]))
                if events[-1]["type"] == "start":
                    ws.send_json({"type": "end"})


WS_CASES = [
    ("api_key=k1", [], True),
    ("", [("Authorization", "Bearer k2")], True),
    ("api_key=k1", [BASIC], True),
    ("api_key=k1", [("Authorization", "Bearer k1")], True),
    ("", [], False),
    ("api_key=k3", [], False),
    ("api_key=junk&api_key=k1", [], False),
    ("api_key=k1&api_key=k1", [], False),
    ("api_key=k1", [BASIC, ("Authorization", "Bearer junk")], False),
    ("api_key=k1", [("Authorization", "Bearer k2")], False),
    ("api_key=k1", [("Authorization", "Bearer junk")], False),
]


@pytest.mark.parametrize(("query", "headers", "ok"), WS_CASES)
def test_websocket_key_rules(local, query, headers, ok):
    events, code = _ws_open(local, query, headers)
    if ok:
        assert [e["type"] for e in events] == ["start", "end"] and code == 1000, events
        return
    assert len(events) == 1 and code == 1008, events
    assert events[0]["type"] == "error" and events[0]["code"] == "invalid_api_key" and "key" in events[0]["message"]


# ------------------------------------------------------------------ Host and Origin (DNS rebinding, other sites)


def test_a_loopback_server_answers_loopback_host_names_only(auth_server, http):
    """Bound to 127.0.0.1 and no allowed_hosts: a page of another site whose name was rebound to 127.0.0.1
    sends its own name as Host, and is refused; the loopback names, with any port, are served."""
    for host in ("attacker.example", "attacker.example:8000", "127.0.0.1.attacker.example", "localhost.example"):
        check_openai_error(http.get("/health", headers={"Host": host}), 400)
    for host in ("localhost", "LOCALHOST:1", "127.0.0.1", "127.0.0.1:8000", "[::1]", "[::1]:8000"):
        assert http.get("/health", headers={"Host": host}).status_code == 200, host
    url = auth_server.replace("http://", "ws://") + "/v1/tts/stream?api_key=k1"
    rebound = {"Host": "attacker.example", "Origin": "http://attacker.example"}
    with pytest.raises(InvalidStatus) as refused:
        connect(url, additional_headers=rebound, open_timeout=10, close_timeout=5)
    assert refused.value.response.status_code == 403


def test_http_from_another_origin_is_refused(auth_server, http):
    """A browser page of another site may send simple requests (a form's multipart POST) without asking:
    a request with a foreign Origin is refused before it does anything; the server's own page (same
    origin, as the playground calls the API) and clients without Origin are served."""
    key = {"Authorization": "Bearer k1"}
    upload = {"files": {"file": ("a.wav", b"RIFF", "audio/wav")}, "data": {"name": "x-origin"}}
    for origin in ("http://attacker.example", "null", auth_server.replace("127.0.0.1", "localhost")):
        r = http.post("/v1/voices", headers={**key, "Origin": origin}, **upload)
        assert check_openai_error(r, 403)["code"] == "bad_origin", origin
        check_openai_error(http.get("/health", headers={"Origin": origin}), 403)
    assert http.get("/v1/voices/x-origin", headers=key).status_code == 404  # nothing was done
    same = http.post("/v1/voices", json={"name": "same", "seed": 1}, headers={**key, "Origin": auth_server})
    assert same.status_code == 201, same.text
    assert http.delete("/v1/voices/same", headers=key).status_code == 200


@pytest.mark.parametrize(
    ("bound", "local", "allowed", "host", "ok"),
    [
        ("127.0.0.1", "127.0.0.1", (), "attacker.example", False),
        ("::1", "::1", (), "attacker.example", False),
        ("localhost", "127.0.0.1", (), "[::1]:80", True),
        ("127.0.0.1", "127.0.0.1", (), None, True),  # no Host: not a browser, so not a rebound page
        ("0.0.0.0", "10.0.0.5", (), "attacker.example", True),  # bound elsewhere: any host unless listed
        ("0.0.0.0", "127.0.0.1", (), "tts.example", True),  # (a sidecar proxy passing on its Host)
        ("127.0.0.1", "10.0.0.5", (), "tts.example", True),  # Ray Serve: its proxy listens, not `host`
        ("127.0.0.1", "127.0.0.1", ("tts.example",), "TTS.example:443", True),
        ("127.0.0.1", "127.0.0.1", ("tts.example",), "localhost", False),  # a list replaces the default
        ("127.0.0.1", "127.0.0.1", ("*",), "attacker.example", True),
        ("127.0.0.1", "127.0.0.1", ("[::1]",), "[::1]:8000", True),
    ],
)
def test_host_check(bound, local, allowed, host, ok):
    from chattts_serve.server.auth import foreign
    from chattts_serve.server.config import ServerConfig

    scope = {**_scope("http", [("Host", host)] if host else []), "server": (local, 8000)}
    config = ServerConfig(host=bound, allowed_hosts=allowed)
    assert foreign(scope, config) == (None if ok else "host")


def test_origin_check():
    from chattts_serve.server.auth import foreign
    from chattts_serve.server.config import ServerConfig

    def check(origin: str, host: str = "localhost:8000", allowed: tuple[str, ...] = ()) -> str | None:
        scope = {**_scope("http", [("Host", host), ("Origin", origin)]), "server": ("127.0.0.1", 8000)}
        return foreign(scope, ServerConfig(allowed_origins=allowed))

    assert check("http://localhost:8000") is None and check("http://localhost:8000/") is None
    assert check("http://localhost", host="localhost") is None  # the default port on both sides
    for origin in ("http://localhost:8001", "http://127.0.0.1:8000", "http://localhost.example:8000", "null", "x"):
        assert check(origin) == "origin", origin
    assert check("https://app.example", allowed=("https://app.example",)) is None
    assert check("http://localhost:8000", allowed=("https://app.example",)) == "origin"  # a list replaces it
    assert check("null", allowed=("*",)) is None


@pytest.mark.parametrize(
    ("host", "keys", "warns"),
    [("127.0.0.1", (), False), ("::1", (), False), ("localhost", (), False), ("0.0.0.0", (), True),
     ("::", (), True), ("192.168.1.5", (), True), ("0.0.0.0", ("k",), False)],
)  # fmt: skip
def test_an_open_bind_without_keys_is_warned_about(host, keys, warns):
    from chattts_serve.server.auth import KeyRing, open_to_anyone

    message = open_to_anyone(host, KeyRing.from_keys(keys))
    assert (message is not None) == warns
    if warns:
        assert host in message and "--api-keys" in message
    assert open_to_anyone("0.0.0.0", KeyRing.from_tenants({"a": ("k",)})) is None
