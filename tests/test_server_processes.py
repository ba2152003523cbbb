"""`liteinfer serve --api-server-count 2` operated over real HTTP: /health that answers 200
only while requests are admitted (503 while starting, after SIGTERM, while an API server is
down); a request limit that holds for the whole server; an API-server process killed and
replaced while the other serves; the engine core's stats line in the log."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from liteinfer.engine.core_process import process_alive
from liteinfer.entrypoints.openai.api_server import MAX_RESTARTS, RESTART_WINDOW_S, RestartBudget
from test_server_limits import (
    LISTEN,
    assert_openai_error,
    metrics,
    sockets_per_process,
    spawned_children,
    start_server,
)

MAX_NUM_SEQS, MAX_WAITING = 4, 8
GRACE_S = 3.0
# A stats line of the engine core's process (the log format names the process).
STATS_LINE = re.compile(rb"INFO liteinfer-engine-core liteinfer\.engine\.core_process: prompt "
                        rb"[\d.]+ tok/s, generation ([\d.]+) tok/s, running \d+, waiting \d+")


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    """(process, base URL, log file) of two API servers on one core, holding at most 4
    running and 8 waiting requests. /health answered 503 (never a hang) until it served."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    starting: list[httpx.Response] = []
    proc, base = start_server(tiny_llama_dir, "--api-server-count", "2", "--max-num-seqs",
                              str(MAX_NUM_SEQS), "--max-waiting-requests", str(MAX_WAITING),
                              "--shutdown-grace", str(GRACE_S), log=log, statuses=starting)
    try:
        assert starting, "/health never answered while the server started"
        for r in starting:
            assert_openai_error(r, 503)
        yield proc, base, log
    finally:
        proc.kill()
        proc.wait()


def api_servers(server_pid: int, port: int) -> list[int]:
    """The API-server processes listening on the port (a replacement once it serves)."""
    children = spawned_children(server_pid)
    return [pid for pid, n in sockets_per_process(children, port, LISTEN).items() if n]


def port_of(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


async def completion(client: httpx.AsyncClient, max_tokens: int) -> httpx.Response:
    return await client.post("/v1/completions", json={
        "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})


def test_a_burst_never_exceeds_the_server_wide_limit(server):
    """300 requests at once on two API servers: /metrics never shows more than 4 running
    and 8 waiting; each is served whole or refused with a 503 that gives the server's limit."""
    _, base, _ = server
    limit = MAX_NUM_SEQS + MAX_WAITING
    seen: list[tuple[float, float]] = []
    done = threading.Event()

    def scrape() -> None:
        while not done.is_set():
            m = metrics(base)
            seen.append((m["liteinfer:num_requests_running"],
                         m["liteinfer:num_requests_waiting"]))
            time.sleep(0.02)

    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
            # Long enough that the burst arrives while the first admitted ones still run.
            return await asyncio.gather(*(completion(client, 64) for _ in range(300)))

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        responses = asyncio.run(burst())
    finally:
        done.set()
        scraper.join()
    served = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    assert len(served) >= limit and refused
    for r in served:
        assert r.json()["usage"]["completion_tokens"] == 64
    for r in refused:
        assert_openai_error(r, 503, f"at most {limit})")
    assert seen and max(running for running, _ in seen) <= MAX_NUM_SEQS
    assert max(running + waiting for running, waiting in seen) <= limit, seen


def test_the_core_logs_one_stats_line_under_load(server):
    """Under load, the engine core's stats line shows tokens generated within 25 s; none from
    the API servers. A line may count only admissions: the interval can end between a
    request's admission and its first token."""
    _, base, log = server
    start, offset = time.monotonic(), log.stat().st_size
    stop = threading.Event()

    def load() -> None:
        async def streams() -> None:
            async with httpx.AsyncClient(base_url=base, timeout=60) as client:
                while not stop.is_set():
                    await asyncio.gather(*(completion(client, 8) for _ in range(MAX_NUM_SEQS)))
        asyncio.run(streams())

    thread = threading.Thread(target=load)
    thread.start()
    try:
        while not any(float(rate) > 0 for rate in STATS_LINE.findall(log.read_bytes()[offset:])):
            assert time.monotonic() - start < 25, "no stats line with tokens generated in 25 s"
            time.sleep(0.2)
    finally:
        stop.set()
        thread.join()
    assert b"api-server" not in b"".join(line for line in log.read_bytes().splitlines()
                                         if b"tok/s" in line)


def health_after(base: str, since: float, until) -> list[tuple[float, int | str]]:
    """/health's answers (or connection errors) by when each was asked, from `since` until
    `until(answers)` holds."""
    answers: list[tuple[float, int | str]] = []
    with httpx.Client(base_url=base, timeout=10,
                      limits=httpx.Limits(max_keepalive_connections=0)) as c:
        while not until(answers):
            asked = time.monotonic() - since
            try:
                answers.append((asked, c.get("/health").status_code))
            except httpx.TransportError as e:
                answers.append((asked, type(e).__name__))
            time.sleep(0.02)
    return answers


def test_a_killed_api_server_is_replaced_while_the_other_serves(server):
    proc, base, _ = server
    port = port_of(base)
    before = api_servers(proc.pid, port)
    assert len(before) == 2
    killed = time.monotonic()
    os.kill(before[0], signal.SIGKILL)
    with ThreadPoolExecutor(1) as pool:
        # /health: 503 when asked 0.5 s after the kill, until the new API server serves.
        health = pool.submit(health_after, base, killed, lambda a: (
            503 in [status for _, status in a] and a[-1][1] == 200)
            or time.monotonic() - killed > 120)
        while process_alive(before[0]):  # its listening socket is closed once it is gone
            time.sleep(0.01)
        # Requests on the other API server complete meanwhile.
        with httpx.Client(base_url=base, timeout=60) as c:
            for _ in range(4):
                r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 8})
                assert r.status_code == 200, r.text
        answers = health.result()
    assert answers[-1][1] == 200, answers[-5:]
    assert 503 in [status for _, status in answers], answers
    assert all(status == 503 for asked, status in answers[:-1] if asked > 0.5), answers
    now = api_servers(proc.pid, port)
    (new,) = set(now) - set(before)
    assert len(now) == 2 and proc.poll() is None
    # The new process serves: streams until one of them is its connection.
    for _ in range(64):
        with httpx.Client(base_url=base, timeout=60) as c, c.stream(
                "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 8, "stream": True,
                                                 "ignore_eos": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            on_new = sockets_per_process([new], port)[new] > 0
            events = [first, *(line for line in lines if line.startswith("data: "))]
        assert events[-1] == "data: [DONE]" and "error" not in json.loads(events[-2][6:])
        if on_new:
            break
    else:
        raise AssertionError("the new API server got none of 64 connections")
    assert proc.poll() is None


def test_sigterm_turns_health_503_then_the_server_exits(server):
    proc, base, _ = server

    async def long_stream() -> None:  # keeps its API server draining for the grace period
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            body = {"prompt": "x", "max_tokens": 240, "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    pass

    thread = threading.Thread(target=asyncio.run, args=(long_stream(),))
    thread.start()
    time.sleep(0.5)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    answers = health_after(base, sent, lambda a: time.monotonic() - sent > 1.5)
    thread.join()
    assert all(status != 200 for asked, status in answers if asked > 0.5), answers
    assert 503 in [status for _, status in answers]
    assert proc.wait(timeout=GRACE_S + 15) == 0


def test_api_servers_dying_repeatedly_end_the_server(tiny_llama_dir, tmp_path):
    """Past MAX_RESTARTS replacements within the window the server gives up: it exits with an
    error instead of restarting API servers that keep dying."""
    log = tmp_path / "serve.log"
    proc, base = start_server(tiny_llama_dir, "--api-server-count", "2", "--shutdown-grace",
                              "1", log=log)
    try:
        (core,) = set(spawned_children(proc.pid)) - set(api_servers(proc.pid, port_of(base)))

        def api_server_pids() -> set[int]:
            return set(spawned_children(proc.pid)) - {core}

        deadline = time.monotonic() + 60
        for _ in range(MAX_RESTARTS + 1):
            while len(api_server_pids()) < 2:  # the last one's replacement is started
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.01)
            victim = max(api_server_pids())
            os.kill(victim, signal.SIGKILL)
            while proc.poll() is None and victim in spawned_children(proc.pid):
                time.sleep(0.01)  # until the server has reaped it
        assert proc.wait(timeout=30) == 1
        assert f"{MAX_RESTARTS + 1} API-server processes died within" in log.read_text()
    finally:
        proc.kill()
        proc.wait()


def test_restarts_are_bounded():
    budget = RestartBudget()
    assert all(budget.take(t) for t in range(MAX_RESTARTS))
    assert not budget.take(MAX_RESTARTS)
    assert budget.take(RESTART_WINDOW_S + 0.5)  # the first has left the window
