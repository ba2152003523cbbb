"""Where one stream's first token goes: the same 128-token prompts, one request at a time,
through (1) the offline engine, (2) AsyncLLM and its engine-core process with no HTTP, (3)
`liteinfer serve` with one and with four API-server processes, measured by the load generator,
and (4) the one-server `liteinfer serve` from a plain blocking socket, which leaves out the
load generator's own (its HTTP client's) time.
Llama-3.2-1B config, dummy bf16 weights, greedy.

(2) also gives the time from the core having a first token (its step's stamp, the request's
`metrics.first_token_time`: perf_counter, the front end's clock too) to the stream's reader
having it.
Prints TTFT p50 per stage; with $OUT set, writes $OUT/profile-ttft.json.

    python scripts/profile_ttft.py [--model DIR] [--requests 32] [--dtype float32]

(--dtype float32 with a tiny model directory runs it on a CPU: the engine's time is then the
CPU's, but what HTTP and the core's process add shows all the same.)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

import numpy as np

from liteinfer import LLM, SamplingParams
from liteinfer.bench.runner import workload
from liteinfer.bench.serve import Job, Target, request_body, run_load
from liteinfer.bench.workloads import SEED, Shape
from liteinfer.engine.async_llm import AsyncLLM

MODEL = "benchmarks/models/llama-3.2-1b-instruct"
SHAPE = Shape(128, 16)
ENGINE_ARGS = {"dtype": "bfloat16", "max_model_len": 16384}  # --dtype replaces the dtype
PORT = 8411


def p50_ms(seconds: list[float]) -> float:
    return round(1e3 * float(np.median(seconds)), 3)


def offline(model: str, prompts: list[list[int]]) -> dict[str, Any]:
    llm = LLM(model, load_format="dummy", **ENGINE_ARGS)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=SHAPE.osl, ignore_eos=True,
                            detokenize=False)
    ttft = []
    for i, prompt in enumerate(prompts):
        start = time.perf_counter()
        engine.add_request(f"r{i}", prompt, params)
        first = None
        while engine.has_unfinished_requests():
            outs = engine.step()
            if first is None and any(o.outputs[0].token_ids for o in outs):
                first = time.perf_counter()
        ttft.append(first - start)
    return {"ttft_p50_ms": p50_ms(ttft[2:])}


async def through_async_llm(model: str, prompts: list[list[int]]) -> dict[str, Any]:
    engine = AsyncLLM.from_args(model, load_format="dummy", **ENGINE_ARGS)
    await engine.start()
    params = SamplingParams(temperature=0.0, max_tokens=SHAPE.osl, ignore_eos=True)
    ttft, delivery = [], []
    try:
        for i, prompt in enumerate(prompts):
            start = time.perf_counter()
            stream = await engine.add_requests([(f"r{i}", prompt, params)])
            first = None
            async for out in stream:
                if first is None:
                    first = time.perf_counter()
                    # The core's stamp of the step that gave the first token.
                    delivery.append(first - out.metrics.first_token_time)
            ttft.append(first - start)
    finally:
        await engine.stop()
        engine.shutdown()
    return {"ttft_p50_ms": p50_ms(ttft[2:]), "core_to_stream_p50_ms": p50_ms(delivery[2:])}


def through_http(model: str, prompts: list[list[int]], api_servers: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "liteinfer.cli", "serve", model, "--load-format", "dummy",
           "--dtype", ENGINE_ARGS["dtype"], "--max-model-len", str(ENGINE_ARGS["max_model_len"]),
           "--port", str(PORT), "--api-server-count", str(api_servers)]
    server = subprocess.Popen(cmd)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the server did not start") from None
                time.sleep(0.5)
        target = Target(f"http://127.0.0.1:{PORT}", None)
        jobs = [Job(i, p, SHAPE.osl) for i, p in enumerate(prompts)]
        timings = run_load(target, jobs, 1, 1)
        errors = [t.error for t in timings if t.error]
        assert not errors, errors[:3]
        report = {"ttft_p50_ms": p50_ms([t.events[0] - t.submit for t in timings[2:]])}
        if api_servers == 1:
            report["raw_socket_ttft_p50_ms"] = p50_ms(raw_socket_ttfts(target, jobs)[2:])
        return report
    finally:
        server.terminate()
        server.wait(60)


def raw_socket_ttfts(target: Target, jobs: list[Job]) -> list[float]:
    """Each job over one kept-alive connection: the time from sending the request's bytes
    (built beforehand) to the first bytes of an event with a choice, then the stream read to
    its end."""
    sock = socket.create_connection(("127.0.0.1", PORT))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ttfts = []
    for job in jobs:
        body = json.dumps(request_body(target, job)).encode()
        request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                   b"Content-Type: application/json\r\nContent-Length: "
                   + str(len(body)).encode() + b"\r\n\r\n" + body)
        start = time.perf_counter()
        sock.sendall(request)
        seen, first = b"", None
        while not seen.endswith(b"0\r\n\r\n"):  # the chunked body's last chunk
            data = sock.recv(1 << 16)
            if first is None and b'"choices":[{' in seen + data:
                first = time.perf_counter()
            seen = (seen + data)[-64:]
        ttfts.append(first - start)
    sock.close()
    return ttfts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--dtype", default=ENGINE_ARGS["dtype"])
    ap.add_argument("--stages", default="offline,async_llm,http_1,http_4",
                    help="which of offline, async_llm, http_1 and http_4 to run")
    args = ap.parse_args()
    stages = args.stages.split(",")
    ENGINE_ARGS["dtype"] = args.dtype
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    prompts, _ = workload(SHAPE, args.requests, SEED, vocab)
    report: dict[str, Any] = {}
    if "offline" in stages:
        report["offline"] = offline(args.model, prompts)
        print(report, flush=True)
    if "async_llm" in stages:
        report["async_llm"] = asyncio.run(through_async_llm(args.model, prompts))
        print(report, flush=True)
    for api_servers in (1, 4):
        if f"http_{api_servers}" in stages:
            report[f"http_{api_servers}"] = through_http(args.model, prompts, api_servers)
            print(report, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "profile-ttft.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
