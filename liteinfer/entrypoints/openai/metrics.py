"""Prometheus metrics of a server, under vLLM's names with a `liteinfer:` prefix: token and
request counters, time to first token and end-to-end latency, the scheduler's queue sizes and
the KV pool's use.

Each server owns its registry, so several apps in one process (tests) do not collide. Several
API-server processes (`--api-server-count`) run prometheus_client's multiprocess mode: counters
and histograms live in files under PROMETHEUS_MULTIPROC_DIR, and any process's /metrics adds up
all of them; the scheduler gauges are read live from the core's latest step message."""
from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from liteinfer.engine.async_llm import AsyncLLM
from liteinfer.outputs import RequestOutput

TOKEN_BUCKETS_S = (0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0)
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
        self.itl = metric(Histogram, "inter_token_latency_seconds",
                          "Between a request's consecutive tokens (those arriving together "
                          "share the gap).", buckets=TOKEN_BUCKETS_S)
        self.tpot = metric(Histogram, "request_time_per_output_token_seconds",
                           "A finished request's time per token after its first.",
                           buckets=TOKEN_BUCKETS_S)
        self._last_token: dict[str, float] = {}  # request id -> when its newest tokens came
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
        n = len(out.new_token_ids)
        self.generation_tokens.inc(n)
        if n and len(completion.token_ids) == n:
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            if m.first_token_time is not None:
                self.ttft.observe(m.first_token_time - m.arrival_time)
        if n and m.last_token_time is not None:
            # Tokens that arrive together share the gap since the ones before them; a request's
            # first token has no gap before it.
            before = self._last_token.get(out.request_id)
            gaps = n
            if before is None:
                before, gaps = m.first_token_time, n - 1
            for _ in range(gaps):
                self.itl.observe((m.last_token_time - before) / gaps)
            self._last_token[out.request_id] = m.last_token_time
        if out.finished:
            self._last_token.pop(out.request_id, None)
            tokens = len(completion.token_ids)
            if tokens > 1 and m.first_token_time is not None and m.last_token_time is not None:
                self.tpot.observe((m.last_token_time - m.first_token_time) / (tokens - 1))
            self._success.labels(**self._labels,
                                 finished_reason=completion.finish_reason).inc()
            if m.finished_time is not None:
                self.e2e.observe(m.finished_time - m.arrival_time)

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drops what is kept of requests that end without a finished output (aborted)."""
        for rid in request_ids:
            self._last_token.pop(rid, None)

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
        # Counts since the engine core started, as its step messages report them.
        counts = [
            ("num_preemptions", "Requests preempted (their KV recomputed later).",
             stats.num_preemptions),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             stats.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             stats.prefix_cache_hits)]
        spec = stats.spec_decoding
        if spec is not None:  # vLLM's speculative-decoding counters, with its meanings
            counts += [
                ("spec_decode_num_drafts", "Sequences' drafts verified (one per sequence and "
                 "step).", spec.num_drafts),
                ("spec_decode_num_draft_tokens", "Draft tokens verified.",
                 spec.num_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                 spec.num_accepted_tokens)]
        for name, doc, value in counts:
            counter = CounterMetricFamily(f"liteinfer:{name}", doc, labels=("model_name",))
            counter.add_metric((self.model_name,), value)
            yield counter
        if spec is None:
            return
        per_pos = CounterMetricFamily(
            "liteinfer:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each position of the drafts.",
            labels=("model_name", "position"))
        for pos, value in enumerate(spec.num_accepted_tokens_per_pos):
            per_pos.add_metric((self.model_name, str(pos)), value)
        yield per_pos
