"""ServeSettings -> Serve deployment options and applications (pure: no Ray), and the metrics mirror."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from chattts_serve.distributed.metrics_export import RayMetricsMirror
from chattts_serve.distributed.settings import ServeSettings, parse_autoscale, plan_applications

TENANTS = {
    "tenants": [
        {"name": "acme", "api_keys": ["ka"], "max_concurrent": 2},
        {"name": "vip", "api_keys": ["kv"], "dedicated": {"autoscale": "1:3"}},
    ]
}


def test_fixed_replicas_options_from_the_slot_count():
    s = ServeSettings.from_dict({"server": {"model": "/m", "max_num_seqs": 8}, "num_replicas": 2, "num_cpus": 0.5})
    opts = s.deployment_options(cluster_gpus=0)
    assert opts["num_replicas"] == 2 and "autoscaling_config" not in opts
    # Two batches of 8 slots (not Ray's default of 5), plus 16 open WebSockets (each is ongoing for Ray).
    assert opts["max_ongoing_requests"] == 2 * 8 + 16
    assert opts["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 0.0}
    assert opts["graceful_shutdown_timeout_s"] >= 600  # the longest request (max_audio_seconds) can finish
    assert s.deployment_options(cluster_gpus=2)["ray_actor_options"]["num_gpus"] == 1.0


def test_autoscaling_targets_the_slot_count():
    s = ServeSettings.from_dict(
        {
            "server": {"max_num_seqs": 4},
            "autoscale": "1:4",
            "upscale_delay_s": 2,
            "autoscaling_extra": {"look_back_period_s": 3},
        }
    )
    auto = s.deployment_options(0)["autoscaling_config"]
    assert auto == {
        "min_replicas": 1,
        "max_replicas": 4,
        "initial_replicas": 1,
        "target_ongoing_requests": 4,
        "upscale_delay_s": 2,
        "downscale_delay_s": 600.0,
        "look_back_period_s": 3,
    }
    assert "num_replicas" not in s.deployment_options(0)


@pytest.mark.parametrize("bad", ["4", "3:1", "a:b", "0:0"])
def test_bad_autoscale(bad):
    with pytest.raises(ValueError, match="autoscale"):
        parse_autoscale(bad)


def test_settings_round_trip_and_checks():
    s = ServeSettings.from_dict(
        {"server": {"model": "/m", "allowed_hosts": ["a"]}, "tenants": TENANTS, "recycle": {"max_requests": 9}}
    )
    assert ServeSettings.from_dict(s.to_dict()) == s
    assert s.server_config().allowed_hosts == ("a",)
    with pytest.raises(ValueError, match="unknown setting"):
        ServeSettings.from_dict({"replicas": 2})
    with pytest.raises(ValueError, match="unknown server option"):
        ServeSettings.from_dict({"server": {"modell": "/m"}})
    with pytest.raises(ValueError, match="port"):
        ServeSettings.from_dict({"server": {"port": 0}})
    with pytest.raises(ValueError, match="either"):
        ServeSettings.from_dict({"server": {"api_keys": ["k"]}, "tenants": TENANTS})


def test_queued_and_idle_requests_cannot_fill_a_replica_for_ray():
    """A request waiting for its tenant's slot, and an open WebSocket, are ongoing for Serve: its cap leaves room
    for every served tenant's queue and the WebSocket allowance on top of the two batches of KV slots."""
    tenants = {
        "tenants": [
            {"name": "a", "api_keys": ["ka"], "max_concurrent": 2, "max_queued": 10},
            {"name": "b", "api_keys": ["kb"], "max_concurrent": 1, "max_queued": 5},
            {"name": "c", "api_keys": ["kc"], "max_queued": 7},  # no cap: it never queues
            {"name": "v", "api_keys": ["kv"], "max_concurrent": 1, "max_queued": 100, "dedicated": {"num_replicas": 1}},
        ]
    }
    s = ServeSettings.from_dict({"server": {"max_num_seqs": 4}, "tenants": tenants, "websocket_sessions": "8"})
    shared, vip = plan_applications(s)
    assert shared.deployment_options(0)["max_ongoing_requests"] == 2 * 4 + 10 + 5 + 8
    assert vip.deployment_options(0)["max_ongoing_requests"] == 2 * 4 + 100 + 8
    assert ServeSettings(max_ongoing_requests=3).deployment_options(0)["max_ongoing_requests"] == 3  # as given
    with pytest.raises(ValueError, match="websocket_sessions"):
        ServeSettings(websocket_sessions=-1)


@pytest.mark.parametrize("server", [{"wyoming_uri": "tcp://0.0.0.0:10200"}, {"wyoming_uri": "tcp://127.0.0.1:1"}])
def test_wyoming_is_refused_on_ray(server):
    """Every replica would bind the same port, and Wyoming has no authentication."""
    with pytest.raises(ValueError, match="does not serve Wyoming"):
        ServeSettings.from_dict({"server": server})


def test_proxy_options_and_what_only_a_proxy_in_front_enforces():
    from chattts_serve.distributed.settings import PROXY_ONLY_LIMITS
    from chattts_serve.server.config import ServerConfig

    s = ServeSettings.from_dict({"server": {"host": "0.0.0.0", "port": 8100}})
    http = s.http_options()
    assert http == {"host": "0.0.0.0", "port": 8100, "request_timeout_s": None, "keep_alive_timeout_s": 5}
    assert set(PROXY_ONLY_LIMITS) <= set(ServerConfig.flat_defaults())


def _ray_serve_args(*flags: str):
    from chattts_serve.cli import _build_parser

    return _build_parser().parse_args(["ray", "serve", "--model", "/m", *flags])


@pytest.mark.parametrize("flags", [["--max-connections", "10"], ["--header-timeout-s", "5"]])
def test_ray_serve_refuses_the_limits_only_a_proxy_enforces(flags, monkeypatch, capsys):
    """Serve's proxy takes any number of connections and waits for headers forever: a flag that says
    otherwise is refused by name (issue 29, item 10), not silently ignored, and ``ray serve --help`` does
    not offer it; a Serve config naming one is refused the same way."""
    from chattts_serve.distributed.cli import serve_settings

    for name in ("CHATTTS_SERVE_MAX_CONNECTIONS", "CHATTTS_SERVE_HEADER_TIMEOUT_S"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=f"ray serve cannot enforce {flags[0]}: .*proxy in front"):
        serve_settings(_ray_serve_args(*flags))
    option = flags[0][2:].replace("-", "_")
    with pytest.raises(ValueError, match=f"cannot enforce {option}: .*docs/ray.md"):
        ServeSettings.from_dict({"server": {option: int(flags[1])}})
    with pytest.raises(SystemExit):
        _ray_serve_args("--help")
    assert flags[0] not in capsys.readouterr().out


def test_ray_serve_ignores_them_from_the_environment_with_a_warning(monkeypatch, caplog):
    """``serve`` and ``ray serve`` may share an environment (a container's): there it is a warning."""
    from chattts_serve.distributed.cli import serve_settings

    monkeypatch.setenv("CHATTTS_SERVE_MAX_CONNECTIONS", "10")
    monkeypatch.delenv("CHATTTS_SERVE_HEADER_TIMEOUT_S", raising=False)
    settings = serve_settings(_ray_serve_args())
    assert "max_connections" not in settings.server and "header_timeout_s" not in settings.server
    assert "ignored on Ray Serve: CHATTTS_SERVE_MAX_CONNECTIONS" in caplog.text


def test_dedicated_tenants_get_their_own_application():
    s = ServeSettings.from_dict({"server": {"model": "/m"}, "tenants": TENANTS, "num_replicas": 2})
    shared, vip = plan_applications(s)
    assert (shared.name, shared.route_prefix, shared.num_replicas) == ("chattts", "/", 2)
    assert shared.server_config().api_keys == ("ka",)  # the vip key is not accepted on the shared replicas
    assert (vip.name, vip.route_prefix, vip.autoscale) == ("chattts-vip", "/tenants/vip", (1, 3))
    assert vip.server_config().api_keys == ("kv",)
    only_vip = ServeSettings.from_dict({"tenants": {"tenants": [TENANTS["tenants"][1]]}})
    assert [p.name for p in plan_applications(only_vip)] == ["chattts-vip"]
    with pytest.raises(ValueError, match="serves no tenant"):
        only_vip.server_config()


def test_mirror_copies_every_series_with_its_labels():
    registry = CollectorRegistry()
    requests = Counter("chattts_requests", "r", ["endpoint", "status"], registry=registry)
    slots = Gauge("chattts_kv_slots_used", "s", registry=registry)
    Histogram("chattts_latency", "l", buckets=(1.0,), registry=registry).observe(0.5)
    requests.labels("speech", "stop").inc(3)
    slots.set(2)
    made = {}

    class FakeGauge:
        def __init__(self, name, doc, keys):
            self.name, self.keys, self.values = name, keys, {}
            made[name] = self

        def set(self, value, tags=None):
            self.values[tuple(sorted((tags or {}).items()))] = value

    mirror = RayMetricsMirror(registry, FakeGauge)
    mirror.sync()
    assert made["chattts_requests_total"].values == {(("endpoint", "speech"), ("status", "stop")): 3.0}
    assert made["chattts_requests_total"].keys == ("endpoint", "status")
    assert made["chattts_kv_slots_used"].values == {(): 2.0}
    assert made["chattts_latency_bucket"].values[(("le", "1.0"),)] == 1.0
    assert not any(name.endswith("_created") for name in made)
    slots.set(5)
    mirror.sync()  # the same gauges, new values
    assert made["chattts_kv_slots_used"].values == {(): 5.0}


def test_the_documented_serve_config_is_valid(tmp_path):
    """deploy/ray-serve.yaml passes Serve's own schema, and each application's args make ServeSettings; it
    listens on every interface, so it ships with keys on (a tenants file, mounted from a secret)."""
    yaml = pytest.importorskip("yaml")
    pytest.importorskip("ray", reason="needs the .[ray] extra")
    import json
    from pathlib import Path

    from ray.serve.schema import ServeDeploySchema

    path = Path(__file__).parents[2] / "deploy" / "ray-serve.yaml"
    config = yaml.safe_load(path.read_text())
    ServeDeploySchema.model_validate(config)
    assert config["http_options"]["host"] == "0.0.0.0"
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"tenants": [{"name": "default", "api_keys": ["sk-test"]}]}))
    for app in config["applications"]:
        assert app["import_path"] == "chattts_serve.distributed.serve_app:app"
        args = app["args"]
        assert args["tenants"].startswith("/etc/"), "keys on: every application reads a tenants file"
        settings = ServeSettings.from_dict({**args, "tenants": str(tenants)})
        assert settings.server_config().api_keys == ("sk-test",)
        assert settings.deployment_options(cluster_gpus=0)["max_ongoing_requests"] == 2 * 16 + 16
        assert "wyoming_uri" not in args["server"]
