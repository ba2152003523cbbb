"""Prometheus metrics of a server, under vLLM's names with a `liteinfer:` prefix: token and
request counters, time to first token and end-to-end latency, the scheduler's queue sizes and
the KV pool's use.

Each server owns its registry, so several apps in one process (tests) do not collide. Several
API-server processes (`--api-server-count`) run prometheus_client's multiprocess mode: counters
and histograms live in files under PROMETHEUS_MULTIPROC_DIR, and any process's /metrics adds up
all of them; the scheduler gauges are read live from the core's latest step message."""
from __future__ import annotations

import os
from collections.abc import Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from liteinfer.engine.async_llm import AsyncLLM
from liteinfer.outputs import RequestOutput

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine: AsyncLLM, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}

        def metric(kind, name: str, doc: str, extra: tuple[str, ...] = (), **kw):
            m = kind(f"liteinfer:{name}", doc, ("model_name", *extra), registry=self.registry,
                     **kw)
            return m if extra else m.labels(**labels)

        self.prompt_tokens = metric(Counter, "prompt_tokens", "Prompt tokens admitted.")
        self.generation_tokens = metric(Counter, "generation_tokens", "Tokens generated.")
        self._success = metric(Counter, "request_success", "Requests finished, by reason.",
                               ("finished_reason",))
        self._labels = labels
        self.ttft = metric(Histogram, "time_to_first_token_seconds",
                           "From a request's arrival to its first token.",
                           buckets=LATENCY_BUCKETS_S)
        self.e2e = metric(Histogram, "e2e_request_latency_seconds",
                          "From a request's arrival to its last token.",
                          buckets=LATENCY_BUCKETS_S)
        scheduler = SchedulerGauges(engine, model_name)
        self.registry.register(scheduler)
        # One process's registry holds its own counts only; the files hold every process's.
        self.exposed = self.registry
        if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
            self.exposed = CollectorRegistry()
            MultiProcessCollector(self.exposed)
            self.exposed.register(scheduler)

    def observe(self, out: RequestOutput) -> None:
        """Counts one output of a request as a client receives it."""
        completion, m = out.outputs[0], out.metrics
        self.generation_tokens.inc(len(out.new_token_ids))
        if out.new_token_ids and len(completion.token_ids) == len(out.new_token_ids):
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            if m.first_token_time is not None:
                self.ttft.observe(m.first_token_time - m.arrival_time)
        if out.finished:
            self._success.labels(**self._labels,
                                 finished_reason=completion.finish_reason).inc()
            if m.finished_time is not None:
                self.e2e.observe(m.finished_time - m.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.exposed)


class SchedulerGauges(Collector):
    """The scheduler's state as the core's latest step message reported it."""

    def __init__(self, engine: AsyncLLM, model_name: str):
        self.engine, self.model_name = engine, model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.scheduler_stats
        for name, doc, value in (
                ("num_requests_running", "Requests holding KV blocks.", stats.num_running),
                ("num_requests_waiting", "Requests queued for admission.", stats.num_waiting),
                ("kv_cache_usage_perc", "Fraction of KV blocks in use.", stats.kv_cache_usage)):
            gauge = GaugeMetricFamily(f"liteinfer:{name}", doc, labels=("model_name",))
            gauge.add_metric((self.model_name,), value)
            yield gauge
