"""Prometheus metrics of a server, under vLLM's names with a `liteinfer:` prefix: token and
request counters, time to first token and end-to-end latency, the scheduler's queue sizes and
the KV pool's use.

Each server owns its registry, so several apps in one process (tests) do not collide."""
from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)

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
        # The scheduler's state as the core's latest step message reported it.
        metric(Gauge, "num_requests_running", "Requests holding KV blocks.").set_function(
            lambda: engine.scheduler_stats.num_running)
        metric(Gauge, "num_requests_waiting", "Requests queued for admission.").set_function(
            lambda: engine.scheduler_stats.num_waiting)
        metric(Gauge, "kv_cache_usage_perc", "Fraction of KV blocks in use.").set_function(
            lambda: engine.scheduler_stats.kv_cache_usage)

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
        return generate_latest(self.registry)
