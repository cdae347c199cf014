"""Prometheus metrics of the server, named after vLLM's (with a `minivllm:` prefix).

Engine-wide counts (queues, KV usage, token and preemption counters, prefix cache) are read from the
engine's latest stats snapshot at scrape time; per-request latencies are observed into histograms
when a request ends. Each app has its own CollectorRegistry, so several servers can live in one process.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from minivllm.outputs import RequestOutput

PREFIX = "minivllm:"
# Seconds; a CPU step can take a second, a GPU step a few milliseconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)

# (name, help, key of LLMEngine.get_stats())
_GAUGES = (
    ("num_requests_running", "Requests in the running batch.", "num_running"),
    ("num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
    ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", "kv_cache_usage"),
    ("kv_offload_ram_usage_bytes", "KV tier: bytes of evicted prefix blocks held in RAM.",
     "kv_offload_ram_usage_bytes"),
    ("kv_offload_disk_usage_bytes", "KV tier: bytes of entries in its directory.", "kv_offload_disk_usage_bytes"),
)
_COUNTERS = (
    ("prompt_tokens", "Prompt tokens computed (prefill).", "prompt_tokens"),
    ("generation_tokens", "Tokens generated.", "generation_tokens"),
    ("num_preemptions", "Sequences preempted for lack of KV-cache blocks.", "num_preemptions"),
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    ("kv_offload_ram_hits", "KV tier: prompt tokens whose K/V was copied back from RAM.", "kv_offload_ram_hits"),
    ("kv_offload_disk_hits", "KV tier: prompt tokens whose K/V was read back from disk.", "kv_offload_disk_hits"),
    ("kv_offload_stored_bytes", "KV tier: bytes of evicted blocks copied out of the pool.", "kv_offload_stored_bytes"),
    ("kv_offload_loaded_bytes", "KV tier: bytes copied back into the pool.", "kv_offload_loaded_bytes"),
    ("kv_offload_load_seconds", "KV tier: seconds the steps spent copying blocks back into the pool.",
     "kv_offload_load_seconds"),
    ("kv_offload_read_seconds", "KV tier: seconds the I/O thread spent reading and checking directory entries.",
     "kv_offload_read_seconds"),
    ("kv_offload_dropped_entries", "KV tier: directory entries refused (corrupt, truncated, foreign) or vanished.",
     "kv_offload_dropped_entries"),
    ("kv_offload_write_errors", "KV tier: blocks not kept because the directory could not be written.",
     "kv_offload_write_errors"),
    ("spec_decode_num_drafts", "Speculative decoding: drafts verified.", "spec_decode_num_drafts"),
    ("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified.", "spec_decode_num_draft_tokens"),
    ("spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted.",
     "spec_decode_num_accepted_tokens"),
)


class _EngineStatsCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any]], model_name: str) -> None:
        self._stats = stats
        self._model_name = model_name

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._stats()
        for name, doc, key in _GAUGES:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self._model_name], stats[key])
            yield family
        for name, doc, key in _COUNTERS:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self._model_name], stats[key])
            yield family
        if "moe_expert_tokens" in stats:
            family = CounterMetricFamily(PREFIX + "moe_expert_tokens", "Mixture of experts: tokens routed to each "
                                         "expert of each sparse layer (the routing skew).",
                                         labels=["model_name", "layer", "expert"])
            for layer, counts in enumerate(stats["moe_expert_tokens"]):
                for expert, tokens in enumerate(counts):
                    family.add_metric([self._model_name, str(layer), str(expert)], tokens)
            yield family


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(stats, model_name))
        self._model_name = model_name

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish, per request.", LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS)
        self.finished = Counter(PREFIX + "request_success", "Requests ended, by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)

    def observe_finished(self, out: RequestOutput) -> None:
        """Record one ended request (thread-safe: called from the engine's loop thread)."""
        m = out.metrics
        for histogram, value in ((self.ttft, m.ttft), (self.tpot, m.tpot), (self.e2e, m.e2e),
                                 (self.queue_time, m.queue_time)):
            if value is not None:  # an aborted request may never have been scheduled
                histogram.observe(value)
        self.finished.labels(self._model_name, out.outputs[0].finish_reason).inc()

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
