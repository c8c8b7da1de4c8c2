"""chattts-serve on Ray Serve, for real: a local Ray cluster on 127.0.0.1 (one for the module), joined by
``chattts-serve ray serve --address ...`` with the tiny checkpoint: a shared application of 2 replicas at
``/`` and a dedicated tenant's autoscaling application at ``/tenants/vip``. Everything goes through Serve's
HTTP proxy. Each response names its replica (``X-Chattts-Replica: <id>/<pid>``)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from ..server.conftest import expected_samples, free_port, tts_body
from .conftest import background, cli, ray_cluster, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

KEYS = {"main": "sk-main", "small": "sk-small", "vip": "sk-vip"}
TENANTS = {
    "tenants": [
        {"name": "main", "api_keys": [KEYS["main"]]},
        {"name": "small", "api_keys": [KEYS["small"]], "max_concurrent": 1},
        {"name": "vip", "api_keys": [KEYS["vip"]], "dedicated": {"autoscale": "1:2"}},
    ]
}
REPLICA = "x-chattts-replica"
LONG = 2000  # audio tokens (within a slot's 4096 positions): a stream of tens of seconds here, cut short


def auth(tenant: str = "main") -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


@pytest.fixture(scope="module")
def serve_app(tiny_ckpt, tmp_path_factory):
    """(base URL, cluster, log path) of the running applications."""
    tmp = tmp_path_factory.mktemp("ray-serve")
    (tmp / "tenants.json").write_text(json.dumps(TENANTS))
    port = free_port()
    with ray_cluster() as cluster:
        cmd = cli(
            "ray", "serve", "--address", cluster.address, "--model", str(tiny_ckpt),
            "--host", "127.0.0.1", "--port", str(port), "--num-replicas", "2", "--num-cpus-per-replica", "0.25",
            "--max-num-seqs", "4", "--threads", "1", "--voices-db", str(tmp / "voices.sqlite3"),
            "--tenants", str(tmp / "tenants.json"), "--target-ongoing-requests", "1", "--upscale-delay-s", "1",
            "--autoscaling-config", '{"look_back_period_s": 2}', "--health-check-period-s", "2",
            "--metrics-period-s", "1", "--log-level", "warning",
        )  # fmt: skip
        log = tmp / "ray-serve.log"
        with background(cmd, log) as proc:
            base = f"http://127.0.0.1:{port}"

            def ready() -> bool:
                assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
                return "serving chattts-vip" in log.read_text(errors="replace")

            wait_for(ready, 240, "both applications", log=log)
            yield base, cluster, log


@pytest.fixture(scope="module")
def base(serve_app) -> str:
    return serve_app[0]


def replica_of(resp: httpx.Response) -> tuple[str, int]:
    rid, pid = resp.headers[REPLICA].split("/")
    return rid, int(pid)


def running_replicas(app: str) -> int:
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None:
        return 0
    return sum(d.replica_states.get("RUNNING", 0) for d in status.deployments.values())


class Stream:
    """A long native /v1/tts stream held open by the test: its status, replica, and the bytes read."""

    def __init__(self, base: str, tokens: int, tenant: str = "main", prefix: str = "") -> None:
        self.client = httpx.Client(base_url=base + prefix, timeout=120)
        body = tts_body(tokens, min_new_tokens=tokens)
        self.cm = self.client.stream("POST", "/v1/tts", json=body, headers=auth(tenant))
        self.resp = self.cm.__enter__()
        self.status = self.resp.status_code
        self.chunks = self.resp.iter_bytes()
        self.data = bytearray(next(self.chunks)) if self.status == 200 else bytearray()

    @property
    def replica(self) -> tuple[str, int]:
        return replica_of(self.resp)

    def read_all(self) -> bytes:
        for chunk in self.chunks:
            self.data += chunk
        return bytes(self.data)

    def close(self) -> None:
        try:
            self.cm.__exit__(None, None, None)
        finally:
            self.client.close()


def ray_metric(cluster, name: str, replica: str) -> float:
    """One replica's sample of ``name`` on Ray's metrics endpoint (the replica's own /metrics cannot be
    picked through the proxy: Ray's router sends a request to the least busy replica)."""
    text = httpx.get(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith(f"ray_{name}{{") and f'replica="{replica}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_openai_sdk_streams_through_the_proxy(base):
    from openai import OpenAI

    tokens = 40
    client = OpenAI(base_url=base + "/v1", api_key=KEYS["main"], timeout=120)
    with client.audio.speech.with_streaming_response.create(
        model="tts-1",
        voice="alloy",
        input="今天天气真不错。",
        response_format="pcm",
        extra_body={"seed": 3, "refine_text": False, "min_new_tokens": tokens, "max_new_tokens": tokens},
    ) as response:
        assert response.headers[REPLICA]
        pieces = list(response.iter_bytes())
    pcm = np.frombuffer(b"".join(pieces), dtype="<i2")
    assert len(pcm) == expected_samples(tokens)
    assert np.abs(pcm).max() > 0


def test_sse_websocket_health_and_ready_through_the_proxy(base):
    with httpx.Client(base_url=base, timeout=120, headers=auth()) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/ready").status_code == 200
        assert http.get("/v1/models").status_code == 200
        assert http.get("/ready", headers={"Authorization": "Bearer wrong"}).status_code == 401
        body = {"model": "tts-1", "input": "你好。", "voice": "alloy", "response_format": "pcm", "stream_format": "sse"}
        body |= {"seed": 1, "refine_text": False, "min_new_tokens": 8, "max_new_tokens": 8}
        r = http.post("/v1/audio/speech", json=body)
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        assert r.status_code == 200, r.text
        assert events[-1]["type"] == "speech.audio.done"
    from websockets.sync.client import connect

    url = base.replace("http://", "ws://") + "/v1/tts/stream?api_key=" + KEYS["main"]
    with connect(url, open_timeout=60) as ws:
        ws.send(json.dumps({"type": "start", "text": "你好。", "format": "pcm", **tts_body(8)} | {"type": "start"}))
        ws.send(json.dumps({"type": "end"}))
        audio, kinds = 0, []
        while True:
            msg = ws.recv(timeout=60)
            if isinstance(msg, bytes):
                audio += len(msg)
                continue
            kinds.append(json.loads(msg)["type"])
            if kinds[-1] in ("end", "error"):
                break
    assert kinds[0] == "start" and kinds[-1] == "end" and audio == 2 * expected_samples(8)


def test_requests_land_on_both_replicas(base):
    def one(_):
        r = httpx.post(base + "/v1/tts", json=tts_body(30), headers=auth(), timeout=120)
        assert r.status_code == 200, r.text
        return replica_of(r)[0]

    seen: set[str] = set()
    with ThreadPoolExecutor(4) as pool:
        for _ in range(5):  # concurrent requests: Ray's router sends them to the less loaded replica
            seen |= set(pool.map(one, range(4)))
            if len(seen) >= 2:
                break
    assert len(seen) == 2, seen


def test_a_voice_created_on_one_replica_is_used_on_the_other(base):
    created = httpx.post(base + "/v1/voices", json={"name": "shared-voice", "seed": 11}, headers=auth(), timeout=60)
    assert created.status_code == 201, created.text
    first = replica_of(created)[0]
    body = tts_body(8, voice="shared-voice")

    def from_the_other():
        r = httpx.post(base + "/v1/tts", json=body, headers=auth(), timeout=120)
        assert r.status_code == 200, r.text
        return r if replica_of(r)[0] != first else None

    r = wait_for(from_the_other, 120, "a request served by the other replica", interval=0)
    assert len(r.content) == 2 * expected_samples(8)
    listed = httpx.get(base + "/v1/voices", headers=auth(), timeout=60).json()
    assert "shared-voice" in [v["name"] for v in listed["data"]]


def test_keys_and_voices_hold_per_tenant_through_the_proxy(base):
    """The tenant rules of tests/distributed/test_tenants.py and test_tenant_voices.py, once through Serve's
    proxy: a key of no tenant, a repeated api_key and two Bearer headers are refused; a voice is its
    tenant's alone."""
    body = tts_body(8)
    assert (
        httpx.post(base + "/v1/tts", json=body, headers={"Authorization": "Bearer junk"}, timeout=60).status_code == 401
    )
    twice = f"{base}/v1/tts?api_key=junk&api_key={KEYS['main']}"
    assert httpx.post(twice, json=body, headers=auth(), timeout=60).status_code == 401
    two_headers = [("Authorization", "Bearer junk"), ("Authorization", f"Bearer {KEYS['main']}")]
    assert httpx.post(base + "/v1/tts", json=body, headers=two_headers, timeout=60).status_code == 401
    created = httpx.post(base + "/v1/voices", json={"name": "mains-own", "seed": 5}, headers=auth(), timeout=60)
    assert created.status_code == 201, created.text
    try:
        theirs = httpx.get(base + "/v1/voices", headers=auth("small"), timeout=60).json()["data"]
        assert "mains-own" not in [v["name"] for v in theirs]
        assert httpx.get(base + "/v1/voices/mains-own", headers=auth("small"), timeout=60).status_code == 404
        spoken = httpx.post(base + "/v1/tts", json=tts_body(8, voice="mains-own"), headers=auth("small"), timeout=60)
        assert spoken.status_code == 400 and spoken.json()["error"]["code"] == "unknown_voice"
        assert httpx.delete(base + "/v1/voices/mains-own", headers=auth("small"), timeout=60).status_code == 404
    finally:
        assert httpx.delete(base + "/v1/voices/mains-own", headers=auth(), timeout=60).status_code in (200, 204)


def test_client_disconnect_aborts_on_the_replica(serve_app):
    base, cluster, _ = serve_app
    stream = Stream(base, LONG)
    assert stream.status == 200
    replica = stream.replica[0]
    wait_for(lambda: ray_metric(cluster, "chattts_kv_slots_used", replica) == 1, 30, "the stream's slot in use")
    before = ray_metric(cluster, "chattts_aborted_requests_total", replica)
    stream.close()  # the client goes away mid-stream (it would run for tens of seconds more)
    wait_for(
        lambda: (
            ray_metric(cluster, "chattts_aborted_requests_total", replica) == before + 1
            and ray_metric(cluster, "chattts_kv_slots_used", replica) == 0
        ),
        15,
        "the replica to abort the request and free its slot",
    )


def test_tenant_over_its_cap_gets_429_while_another_is_served(base):
    # "small" may run 1 request per replica: of 3 held open on 2 replicas, at least one is refused.
    streams, statuses = [], []
    try:
        for _ in range(3):
            s = Stream(base, LONG, tenant="small")
            streams.append(s)
            statuses.append(s.status)
            if s.status == 429:
                assert s.resp.headers["retry-after"]
                s.resp.read()
                assert json.loads(s.resp.content)["error"]["code"] == "tenant_capacity"
        assert 429 in statuses and 200 in statuses, statuses
        other = httpx.post(base + "/v1/tts", json=tts_body(8), headers=auth("main"), timeout=120)
        assert other.status_code == 200 and len(other.content) == 2 * expected_samples(8)
    finally:
        for s in streams:
            s.close()


def test_every_replica_exports_its_metrics_to_ray(serve_app):
    _, cluster, _ = serve_app

    def replicas_seen():
        text = httpx.get(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=30).text
        replicas = set()
        rejected_small = False
        for line in text.splitlines():
            if line.startswith("ray_chattts_kv_slots_total{") and 'deployment="chattts"' in line:
                replicas.add(line.split('replica="')[1].split('"')[0])
            if line.startswith("ray_chattts_tenant_rejected_requests_total{") and 'tenant="small"' in line:
                rejected_small |= float(line.rsplit(" ", 1)[1]) > 0
        return len(replicas) >= 2 and rejected_small

    wait_for(replicas_seen, 60, "per-replica and per-tenant series on Ray's metrics endpoint", interval=1)


def test_killing_a_replica_fails_only_its_streams(base):
    doomed = Stream(base, LONG)
    victim = doomed.replica
    survivor = None
    try:
        for _ in range(20):  # a second stream, on the other replica
            s = Stream(base, 600)
            if s.replica[0] != victim[0]:
                survivor = s
                break
            s.close()
        assert survivor is not None, "no stream landed on the other replica"
        os.kill(victim[1], signal.SIGKILL)
        with pytest.raises(httpx.HTTPError):  # cut: no clean end of the chunked body
            doomed.read_all()
        assert len(survivor.read_all()) == 2 * expected_samples(600)  # whole, on the replica still alive
    finally:
        doomed.close()
        if survivor is not None:
            survivor.close()
    r = httpx.post(base + "/v1/tts", json=tts_body(8), headers=auth(), timeout=120)
    assert r.status_code == 200 and replica_of(r)[0] != victim[0]
    wait_for(lambda: running_replicas("chattts") == 2, 120, "Ray to replace the killed replica")


def wanted_replicas(app: str) -> int:
    """Replicas the controller keeps for ``app``: running or still starting (an autoscaling decision shows
    here at once; a replica's start-up, seconds to minutes on a busy 2-core box, does not delay it)."""
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None:
        return 0
    return sum(n for d in status.deployments.values() for state, n in d.replica_states.items() if state != "STOPPING")


def test_a_dedicated_tenant_autoscales_under_load(base):
    """Serve scales the vip tenant's application (autoscale 1:2, target 1 ongoing request) under held load.

    The load is three WebSocket sessions, opened and left idle: a session is one ongoing request for as long
    as its client keeps it, however fast the engine is. (Audio streams were not: Serve counts a streamed
    request as done once the replica has produced it, so on a fast box three long streams ended within the
    autoscaler's look-back, whether the client read them or not, and the test timed out.)"""
    from websockets.sync.client import connect

    vip = "/tenants/vip"
    assert httpx.get(base + vip + "/ready", headers=auth("vip"), timeout=60).status_code == 200
    assert httpx.get(base + vip + "/ready", headers=auth("main"), timeout=60).status_code == 401  # its own keys
    assert httpx.get(base + "/ready", headers=auth("vip"), timeout=60).status_code == 401
    assert running_replicas("chattts-vip") == 1
    url = base.replace("http://", "ws://") + vip + "/v1/tts/stream?api_key=" + KEYS["vip"]
    with contextlib.ExitStack() as held:
        for _ in range(3):  # target 1 ongoing request per replica: 3 held asks for more replicas
            ws = held.enter_context(connect(url, open_timeout=60))
            ws.send(json.dumps({"type": "start", "format": "pcm"}))
            assert json.loads(ws.recv(timeout=60))["type"] == "start"
        wait_for(lambda: wanted_replicas("chattts-vip") >= 2, 120, "the autoscaler to add a vip replica")
        time.sleep(2)
        assert wanted_replicas("chattts-vip") <= 2  # bounded by max_replicas
        wait_for(lambda: running_replicas("chattts-vip") >= 2, 300, "the second vip replica to start")


def test_a_recycled_replica_finishes_its_stream_then_is_replaced(serve_app, tiny_ckpt, tmp_path):
    """An application deployed from this process (a second driver) whose replica must go after 2 requests."""
    from ray import serve

    from chattts_serve.distributed.recycling import RecyclePolicy
    from chattts_serve.distributed.serve_app import bind
    from chattts_serve.distributed.settings import ServeSettings

    base = serve_app[0]
    settings = ServeSettings(
        server={"model": str(tiny_ckpt), "max_num_seqs": 4, "threads": 1, "voices_db": str(tmp_path / "v.sqlite3")},
        name="chattts-recycle",
        route_prefix="/recycle",
        num_cpus=0.25,
        recycle=RecyclePolicy(max_requests=2),
        health_check_period_s=1,
    )
    serve.run(bind(settings, 0), name=settings.name, route_prefix=settings.route_prefix)
    try:
        url = base + "/recycle"
        first = httpx.post(url + "/v1/tts", json=tts_body(8), timeout=120)
        assert first.status_code == 200
        old = replica_of(first)[0]
        stream = Stream(base, 1500, prefix="/recycle")  # in flight while the replica trips
        assert stream.replica[0] == old
        assert httpx.post(url + "/v1/tts", json=tts_body(8), timeout=120).status_code == 200  # 2 served: trips
        try:
            assert len(stream.read_all()) == 2 * expected_samples(1500)  # drained, not cut
        finally:
            stream.close()

        def new_replica():
            r = httpx.post(url + "/v1/tts", json=tts_body(8), timeout=120)
            return r.status_code == 200 and replica_of(r)[0] != old

        wait_for(new_replica, 120, "a fresh replica in place of the recycled one", interval=0.5)
    finally:
        serve.delete(settings.name)


def test_sigterm_ends_a_local_ray_serve_cleanly(tiny_ckpt, tmp_path):
    """``ray serve`` that started its own cluster: SIGTERM deletes the application, stops the cluster and exits 0
    (Ray's own handler, installed when the cluster starts, used to print and exit 1 without deleting it)."""
    port = free_port()
    cmd = cli(
        "ray", "serve", "--model", str(tiny_ckpt), "--host", "127.0.0.1", "--port", str(port), "--num-cpus", "1",
        "--num-replicas", "1", "--num-cpus-per-replica", "0.25", "--max-num-seqs", "2", "--threads", "1",
        "--voices-db", str(tmp_path / "voices.sqlite3"), "--log-level", "warning",
    )  # fmt: skip
    log = tmp_path / "ray-serve.log"
    with background(cmd, log) as proc:
        wait_for(lambda: "serving chattts" in log.read_text(errors="replace"), 240, "the application", log=log)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, log.read_text(errors="replace")[-3000:]
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)  # the proxy is gone with the cluster
