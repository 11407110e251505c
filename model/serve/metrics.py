"""The server's Prometheus metrics (``GET /metrics``), in a registry of their own (several apps may live in
one process). The engine's occupancy is read from the engine client's ``load`` at scrape time (no round
trip to an engine process: its load comes with every step)."""
from __future__ import annotations

from tritune.model.serve.client import LOAD_COUNTERS

# engine counter -> (metric name, help) for the counters of client.LOAD_COUNTERS
COUNTER_DOCS = {"spec_skipped_rows": ("tritune_spec_skipped_rows", "Decode rows that ran without speculative "
                                      "decoding because the batch was above its limit"),
               "spec_over_batch_steps": ("tritune_spec_over_batch_steps", "Decode steps of more rows than "
                                         "speculative decoding's largest batch, run as plain decode steps"),
               "request_errors": ("tritune_request_errors", "Requests the engine ended alone because of a "
                                  "failure of their own (a non-finite logits row, a sampling error)")}


class Metrics:
    """Request, token and latency metrics, the engine's load as gauges, and the engine counters of
    :data:`tritune.model.serve.client.LOAD_COUNTERS` that the engine keeps (absent while it keeps none)."""

    def __init__(self, client):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.requests = Counter("tritune_requests", "Engine requests ended, by finish reason", ["finish_reason"],
                                registry=r)
        self.http_errors = Counter("tritune_http_errors", "Requests answered with an error, by status", ["status"],
                                   registry=r)
        self.prompt_tokens = Counter("tritune_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("tritune_generation_tokens", "Tokens generated", registry=r)
        lat = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram("tritune_time_to_first_token_seconds", "Request arrival to its first token",
                              buckets=lat, registry=r)
        self.tpot = Histogram("tritune_time_per_output_token_seconds", "Mean time per token after the first",
                              buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28),
                              registry=r)
        for name, doc, key in (("tritune_requests_running", "Requests in the running batch", "running"),
                               ("tritune_requests_waiting", "Requests queued in the engine", "waiting"),
                               ("tritune_kv_blocks_used", "KV cache blocks in use", "kv_blocks_used"),
                               ("tritune_kv_blocks_total", "KV cache blocks in the pool", "kv_blocks_total")):
            Gauge(name, doc, registry=r).set_function(lambda k=key: client.load.get(k) or 0)
        Gauge("tritune_requests_in_flight", "Engine requests submitted and not ended (the queue bound counts "
              "these)", registry=r).set_function(lambda: client.in_flight)
        r.register(_EngineCounters(client))

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class _EngineCounters:
    """A collector of the engine counters the engine client's load carries (only those present)."""

    def __init__(self, client):
        self.client = client

    def describe(self) -> list:
        return []       # decided at each scrape: the registry must not call collect() at registration

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        load = self.client.load or {}
        for key in LOAD_COUNTERS:
            if load.get(key) is not None:
                name, doc = COUNTER_DOCS.get(key, (f"tritune_{key}", key))
                yield CounterMetricFamily(name, doc, value=load[key])
