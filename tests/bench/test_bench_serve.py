"""`liteinfer-bench serve` against a real `liteinfer serve` of the tiny model (two API-server
processes on one engine core, over real HTTP): every stream full length, statistics that agree
with each other, rows stored with the offline prompt recipe; the two front ends both serve, give
the offline outputs, and /metrics counts all of their requests; SIGTERM and a dead core end
every process."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from bench_support import LINEAGE

from liteinfer import SamplingParams
from liteinfer.bench.runner import workload
from liteinfer.bench.serve import Job, Timing, spread, summarize_timings
from liteinfer.bench.store import read_jsonl
from liteinfer.bench.workloads import SEED, Shape, fingerprint
from liteinfer.engine.core_process import process_alive
from test_server_limits import front_ends_and_core, sockets_per_process, start_server

PROMPTS = ["The quick brown fox", "Hello world! How are", "Once upon a time there",
           "def add(a, b):", "Caching keys and values", "Numbers: 0 1 2"]
GRACE_S = 2.0


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    """(process, base URL) of `liteinfer serve --api-server-count 2`; it must exit on SIGTERM
    within the grace period."""
    proc, base = start_server(tiny_llama_dir, "--api-server-count", "2",
                              "--shutdown-grace", str(GRACE_S),
                              log=tmp_path_factory.mktemp("serve") / "serve.log")
    try:
        yield proc, base
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        assert proc.wait(timeout=GRACE_S + 15) == 0
        assert time.monotonic() - sent < GRACE_S + 10
    finally:
        proc.kill()
        proc.wait()


def metrics(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics").text
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("liteinfer:") and "_bucket" not in line}


def test_load_generator_against_liteinfer_serve(server, tmp_path):
    _, base = server
    before = metrics(base)["liteinfer:generation_tokens_total"]
    rows_file = tmp_path / "rows.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-m", "liteinfer.bench", "serve", "--base-url", base, "--shape", "16/24",
         "--concurrency", "1", "6", "--prompts", "2", "12", "--processes", "2",
         "--vocab-size", "384", "--run-id", "test", "--out", str(rows_file)],
        env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = read_jsonl(rows_file)
    assert [(r["width"], r["requests"]) for r in rows] == [(1, 2), (6, 12)]
    prompts, fold = workload(Shape(16, 24), 12, SEED, 384)
    for r in rows:
        assert (r["kind"], r["engine"], r["model"], r["run_id"]) == (
            "serve", "liteinfer", "tiny-llama", "test")
        assert r["errors"] == 0 and r["error_samples"] == [] and r["all_forced"]
        assert r["out_tokens"] == 24 * r["requests"]
        assert r["fingerprint"] == fingerprint(prompts[:r["requests"]]) and r["vocab_fold"] == fold
        assert 0 < r["ttft_p50"] <= r["e2e_p50"] and 0 < r["itl_p50"] <= r["e2e_p50"]
        # TPOT spreads what follows the first token over the other 23 tokens.
        assert r["tpot_mean"] == pytest.approx((r["e2e_mean"] - r["ttft_mean"]) / 23, rel=1e-6)
        assert r["tok_s"] == pytest.approx(r["out_tokens"] / r["wall_s"])
        assert r["wall_s"] * 1e3 >= r["e2e_p99"]
        assert r["commit"] and r["gpu"] == "cpu" and r["timestamp"]
    # The server generated exactly the warm-up's (1+2 requests of 12 and 24 tokens; 6 of
    # 4..24) and the measured tokens.
    warm = 12 + 24 + sum(24 * (i + 1) // 6 for i in range(6))
    generated = metrics(base)["liteinfer:generation_tokens_total"] - before
    assert generated == warm + 24 * 14


def test_timings_count_tokens_from_usage():
    """A server that falls behind sends several tokens in one event: TPOT still divides by the
    tokens of the usage; a short or failed stream is an error and leaves the latencies."""
    merged = Timing(0, submit=0.0, events=[0.1, 0.2, 0.5], end=0.5, completion_tokens=5)
    short = Timing(1, submit=0.0, events=[0.1], end=0.3, completion_tokens=3,
                   error="3 tokens generated, 5 asked for")
    stats = summarize_timings([merged, short], osl=5)
    assert stats["ttft_p50"] == pytest.approx(100.0)
    assert stats["tpot_p50"] == pytest.approx(100.0)  # (500 - 100) / (5 - 1)
    assert stats["itl_mean"] == pytest.approx(200.0)  # event gaps 100 and 300
    assert (stats["errors"], stats["out_tokens"], stats["all_forced"]) == (1, 5, False)
    assert stats["tok_s"] == pytest.approx(10.0)


def test_streams_are_spread_over_client_processes():
    jobs = [Job(i, [i], 4) for i in range(10)]
    shares = spread(jobs, concurrency=3, processes=2)
    assert [(sorted(j.index for j in js), n) for js, n in shares] == [
        ([0, 2, 3, 5, 6, 8, 9], 2), ([1, 4, 7], 1)]
    assert [n for _, n in spread(jobs, concurrency=1, processes=4)] == [1]
    assert sorted(j.index for js, _ in spread(jobs, None, 3) for j in js) == list(range(10))


def test_two_front_ends_serve_offline_outputs_and_count_in_metrics(server, tiny_llm):
    proc, base = server
    port = int(base.rsplit(":", 1)[1])
    front_ends, _ = front_ends_and_core(proc.pid, port)
    assert len(front_ends) == 2
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = [o.outputs[0].text for o in tiny_llm.generate(PROMPTS * 2, params,
                                                             use_tqdm=False)]
    before = metrics(base)
    seen: dict[int, int] = {}

    async def run() -> list[str]:
        # One connection per stream: the kernel spreads them over the front ends' sockets.
        async with httpx.AsyncClient(base_url=base, timeout=120,
                                     limits=httpx.Limits(max_keepalive_connections=0)) as c:
            async def one(prompt: str) -> str:
                text = ""
                body = {"prompt": prompt, "max_tokens": 40, "temperature": 0,
                        "ignore_eos": True, "stream": True}
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            text += json.loads(line[6:])["choices"][0]["text"]
                            if not (seen and all(seen.values())):
                                seen.update(sockets_per_process(front_ends, port))
                return text

            return await asyncio.gather(*(one(p) for p in PROMPTS * 2))

    assert asyncio.run(run()) == expected
    assert all(n > 0 for n in seen.values()), f"a front end got no connection: {seen}"
    # Every scrape, whichever process answers it, counts both front ends' requests.
    for _ in range(6):
        m = metrics(base)
        assert m["liteinfer:generation_tokens_total"] - before[
            "liteinfer:generation_tokens_total"] == 40 * len(expected)
        assert m["liteinfer:request_success_total"] - before[
            "liteinfer:request_success_total"] == len(expected)


def test_core_death_ends_every_api_server(tiny_llama_dir, tmp_path):
    proc, base = start_server(tiny_llama_dir, "--api-server-count", "2",
                              log=tmp_path / "serve.log")
    try:
        # /health answered 200, so both front ends serve: each holds its listening socket.
        front_ends, core = front_ends_and_core(proc.pid, int(base.rsplit(":", 1)[1]))
        assert len(front_ends) == 2
        os.kill(core, signal.SIGKILL)
        # The server gives its API servers the grace period and 10 s to exit before it kills
        # them; on a loaded two-core machine their teardown and its own take as long again.
        assert proc.wait(timeout=120) != 0
        deadline = time.monotonic() + 5  # the orphans' last moments, if any
        while any(process_alive(pid) for pid in front_ends) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(process_alive(pid) for pid in front_ends)
    finally:
        proc.kill()
        proc.wait()


def serve_row(engine: str, run_id: str, width: int, tok_s: float, **extra) -> dict:
    return {"kind": "serve", "engine": engine, "config": f"{engine}-serve", "model": "m",
            "isl": 128, "osl": 256, "width": width, "request_rate": None, "tok_s": tok_s,
            "ttft_p50": 2.0, "ttft_p99": 3.0, "tpot_p50": 1.0, "tpot_p99": 1.5, "itl_p50": 0.9,
            "errors": 0, "requests": 16, "all_forced": True, "run_id": run_id, "gpu": "g",
            "timestamp": "2026-12-01T00:00:00+00:00", **extra}


def test_serving_table_compares_with_vllm_serve_of_the_same_run():
    from liteinfer.bench.report import render_markdown
    from liteinfer.bench.tables import build_page

    rows = [serve_row("liteinfer", "a", 32, 30_000.0), serve_row("vllm", "a", 32, 20_000.0),
            serve_row("liteinfer", "a", 128, 50_000.0),
            # vLLM at 128 streams only in another run: no ratio for liteinfer's row of run a.
            serve_row("vllm", "b", 128, 25_000.0),
            # An older measurement of the same load gives way to the newest.
            serve_row("liteinfer", "a", 32, 10_000.0, timestamp="2026-11-01T00:00:00+00:00"),
            # A newer run without vLLM serve does not push run a's compared row out.
            serve_row("liteinfer", "c", 32, 40_000.0, timestamp="2026-12-02T00:00:00+00:00")]
    (table,) = build_page(rows, LINEAGE, "m").serving
    ratios = {(line.row["engine"], line.row["width"]): line.vs_vllm for line in table.lines}
    assert ratios == {("liteinfer", 32): pytest.approx(1.5), ("vllm", 32): None,
                      ("liteinfer", 128): None, ("vllm", 128): None}
    page = render_markdown(build_page(rows, LINEAGE, "m"))
    assert "## serving · m · ISL=128 OSL=256" in page
    assert "| liteinfer-serve | 32 | 30,000.0 | 2.0 | 3.0 | 1.0 | 1.5 | 0.9 | 0 | 1.50x |" in page
    # Without any vLLM serve row, the newest rows are shown.
    (alone,) = build_page([r for r in rows if r["engine"] == "liteinfer"], LINEAGE, "m").serving
    assert {line.row["width"]: line.row["tok_s"] for line in alone.lines} == {
        32: 40_000.0, 128: 50_000.0}
