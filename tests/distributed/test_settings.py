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
    assert opts["max_ongoing_requests"] == 16  # two batches of 8 slots, not Ray's default of 5
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


def test_the_documented_serve_config_is_valid():
    """deploy/ray-serve.yaml passes Serve's own schema, and each application's args make ServeSettings."""
    yaml = pytest.importorskip("yaml")
    pytest.importorskip("ray", reason="needs the .[ray] extra")
    from pathlib import Path

    from ray.serve.schema import ServeDeploySchema

    path = Path(__file__).parents[2] / "deploy" / "ray-serve.yaml"
    config = yaml.safe_load(path.read_text())
    ServeDeploySchema.model_validate(config)
    for app in config["applications"]:
        assert app["import_path"] == "chattts_serve.distributed.serve_app:app"
        settings = ServeSettings.from_dict(app["args"])
        assert settings.deployment_options(cluster_gpus=0)["max_ongoing_requests"] == 32
