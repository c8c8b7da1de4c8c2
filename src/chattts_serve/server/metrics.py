"""Prometheus metrics (``GET /metrics``). One registry per app, so several apps in one process (tests)
do not collide."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

LATENCY_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)


class Metrics:
    def __init__(self, engine=None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "chattts_requests", "Requests by endpoint and final status", ["endpoint", "status"], registry=r
        )
        self.ttfb = Histogram(
            "chattts_time_to_first_audio_seconds",
            "Request start to first audio byte sent",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "chattts_request_latency_seconds",
            "Request start to last byte sent",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.rtf = Histogram(
            "chattts_real_time_factor", "Wall time / audio duration per request", buckets=RTF_BUCKETS, registry=r
        )
        self.audio_seconds = Counter("chattts_audio_seconds", "Seconds of audio produced", registry=r)
        self.rejected = Counter("chattts_rejected_requests", "Requests refused for capacity", ["reason"], registry=r)
        self.aborted = Counter("chattts_aborted_requests", "Requests aborted (client gone, shutdown)", registry=r)
        self.empty_audio = Counter(
            "chattts_empty_audio_responses",
            "Requests that finished without any audio (their code pass ended at step 0)",
            ["endpoint"],
            registry=r,
        )
        self.in_flight = Gauge("chattts_requests_in_flight", "Requests being served", registry=r)
        self.cache_hits = Counter("chattts_cache_hits", "Requests answered from the result cache", registry=r)
        self.cache_misses = Counter(
            "chattts_cache_misses", "Cacheable (seeded) requests the result cache did not hold", registry=r
        )
        self.cache_bytes = Gauge("chattts_cache_bytes", "Bytes the result cache holds", registry=r)
        if engine is not None:
            # The served model, as Prometheus' info pattern: join on it to label any series by family.
            info = Gauge("chattts_model_info", "The served model", ["family", "sample_rate"], registry=r)
            info.labels(engine.family.name, str(engine.sample_rate)).set(1)
            Gauge("chattts_queue_depth", "Sequences waiting for a KV slot", registry=r).set_function(
                lambda: engine.stats().num_waiting
            )
            Gauge("chattts_running_batch_size", "Sequences decoding", registry=r).set_function(
                lambda: engine.stats().num_running
            )
            Gauge("chattts_kv_slots_total", "KV-cache slots", registry=r).set(engine.stats().kv_slots)
            Gauge("chattts_kv_slots_used", "KV-cache slots in use", registry=r).set_function(
                lambda: engine.stats().kv_slots_used
            )
            r.register(_DecodeStepCollector(engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _DecodeStepCollector:
    """How static decode steps ran (``EngineStats``): CUDA graph replays vs eager steps, and graphs
    refused by their self-check. Counters read from the engine at scrape time."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def describe(self) -> list:
        return []  # collected on each scrape only (no engine read at registration)

    def collect(self):
        stats = self.engine.stats()
        for name, doc, attr in (
            ("chattts_cuda_graph_replays", "Static decode steps run by replaying a CUDA graph", "graph_replays"),
            ("chattts_decode_eager_steps", "Static decode steps run eagerly (no graph for the shape)", "eager_steps"),
            ("chattts_cuda_graphs_refused", "CUDA graphs that failed their start-up self-check", "graphs_refused"),
            (
                "chattts_step_graph_replays",
                "Decode steps run by replaying a whole-step graph",
                "step_graph_replays",
            ),
            (
                "chattts_step_graph_eager_steps",
                "Decode steps that ran the whole-step function eagerly",
                "step_graph_eager_steps",
            ),
            ("chattts_step_graphs_refused", "Whole-step graphs that failed their check", "step_graphs_refused"),
        ):
            yield CounterMetricFamily(name, doc, value=getattr(stats, attr, 0))
