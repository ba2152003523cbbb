"""The server under bad input, overload, disconnects and failure, over real HTTP: every refusal
an OpenAI-style 4xx (never a 5xx, never a stack trace), good requests running beside it
unaffected and equal to the offline engine's output, the KV pool whole again afterwards; a dead
engine core and SIGTERM answered with errors, never a silent cut, and the server exiting."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fixtures import LISTENING_URL, serve
from liteinfer import SamplingParams
from liteinfer.engine.async_llm import AsyncLLM
from liteinfer.entrypoints.openai.cli_args import ServerArgs

MODEL = "tiny"
ENGINE_ARGS = dict(dtype="float32", device="cpu", max_model_len=256)
PROMPTS = ["The quick brown fox", "Hello world! How are", "Once upon a time there",
           "def add(a, b):", "Caching keys and values", "Numbers: 0 1 2"]
LIMITS = ServerArgs(max_body_bytes=4096, max_prompts_per_request=4,
                    max_prompt_tokens_per_request=64)


@pytest.fixture(scope="module")
def core(tiny_llama_dir):
    """An engine core and its front end, served with LIMITS."""
    engine = AsyncLLM.from_args(str(tiny_llama_dir), **ENGINE_ARGS)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def url(core):
    with serve(core, MODEL, LIMITS) as base:
        yield base


def reference(llm, prompt: str, n: int) -> str:
    return references(llm, [(prompt, n)])[(prompt, n)]


def references(llm, cases: list[tuple[str, int]]) -> dict[tuple[str, int], str]:
    """Offline greedy outputs of (prompt, max_tokens) pairs, in one batch."""
    cases = sorted(set(cases))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in cases]
    outs = llm.generate([p for p, _ in cases], params, use_tqdm=False)
    return {case: out.outputs[0].text for case, out in zip(cases, outs)}


def assert_openai_error(r: httpx.Response, status: int, needle: str = "") -> None:
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert needle.lower() in error["message"].lower(), error
    assert "Traceback" not in r.text


def metrics(base: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base + "/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("liteinfer:") and not s.labels.keys() - {"model_name"}}


def assert_idle(base: str) -> None:
    """No request left in the core; every KV block back in the pool."""
    deadline = time.monotonic() + 10
    while True:
        m = metrics(base)
        if m["liteinfer:num_requests_running"] == m["liteinfer:kv_cache_usage_perc"] == 0:
            return
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


async def stream_text(client: httpx.AsyncClient, body: dict, stop_after: int | None = None
                      ) -> tuple[str, list]:
    """A streamed completion's text and its events; with stop_after, the client disconnects
    after that many events."""
    text, chunks = "", []
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            chunks.append(payload if payload == "[DONE]" else json.loads(payload))
            if isinstance(chunks[-1], dict) and "choices" in chunks[-1]:
                text += chunks[-1]["choices"][0]["text"]
            if stop_after is not None and len(chunks) >= stop_after:
                break
    return text, chunks


def test_framework_errors_are_openai_errors(url):
    with httpx.Client(base_url=url) as c:
        def post(content, **kw):
            return c.post("/v1/completions", content=content, **kw)
        assert_openai_error(post(b'{"prompt": "x", '), 400, "not valid JSON")
        assert_openai_error(post(b'{"prompt": "\xff\xfe"}'), 400, "UTF-8")
        assert_openai_error(post(b'{"prompt": "\\ud800"}'), 400, "surrogate")
        assert_openai_error(c.post("/v1/chat/completions", content=b'{"messages": [{"role": '
                                   b'"user", "content": "\\udc00 hi"}]}'), 400, "surrogate")
        assert_openai_error(post(b'{"model": "\\ud83d", "prompt": "x"}'), 400, "surrogate")
        assert_openai_error(post(b"[" * 5000 + b"]" * 5000), 413)  # over max_body_bytes
        assert_openai_error(post(b'{"prompt": ' + b"[" * 1500 + b"]" * 1500 + b"}"), 400, "JSON")
        assert_openai_error(post(b'{"prompt": 5}'), 400, "prompt")
        assert_openai_error(post(b'[1, 2]'), 400)
        assert_openai_error(c.get("/v1/nowhere"), 404)
        assert_openai_error(c.get("/v1/completions"), 405)
        assert_openai_error(c.put("/tokenize", json={}), 405)
        assert_openai_error(post(b'{"prompt": "' + b"x" * 5000 + b'"}'), 413, "4096 bytes")

        def chunked():  # no Content-Length: refused while the body arrives
            yield b'{"prompt": "'
            for _ in range(100):
                yield b"x" * 100
            yield b'"}'

        assert_openai_error(post(chunked()), 413)


def test_unsupported_fields_and_zero_lengths_are_refused(url):
    cases = [("/v1/completions", {"suffix": "!"}, "suffix"),
             ("/v1/completions", {"best_of": 3}, "best_of"),
             ("/v1/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
             ("/v1/completions", {"guided_json": {"type": "objectx"}}, "JSON schema"),
             ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
             ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
             ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools"),
             ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
             ("/v1/chat/completions", {"best_of": 2}, "best_of"),
             ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_tokens"),
             ("/v1/chat/completions", {"chat_template": "{{ 1 }}"}, "chat_template"),
             ("/v1/completions", {"seed": 2**64}, "seed"),
             ("/v1/completions", {"seed": -2**63 - 1}, "seed"),
             ("/v1/completions", {"top_k": 10**12}, "top_k"),
             ("/v1/completions", {"top_k": 1000}, "top_k"),  # beyond the 384-token vocabulary
             ("/v1/completions", {"n": 17}, "n"),
             ("/v1/completions", {"logprobs": 21}, "logprobs"),
             ("/v1/completions", {"stop_token_ids": [2**70]}, "stop_token_ids"),
             ("/v1/completions", {"prompt": ["a", "b", "c", "d", "e"]}, "prompts"),
             ("/v1/completions", {"prompt": [[5] * 40, [6] * 40]}, "tokens"),
             ("/v1/completions", {"min_tokens": 10**30}, "min_tokens")]
    with httpx.Client(base_url=url) as c:
        for path, extra, needle in cases:
            base = ({"prompt": "x"} if path == "/v1/completions"
                    else {"messages": [{"role": "user", "content": "x"}]})
            assert_openai_error(c.post(path, json={**base, "max_tokens": 2, **extra}), 400,
                                needle)
        # Their neutral values are accepted; so are the ends of the seed range.
        ok = c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "none", "response_format": {"type": "text"}, "seed": 2**64 - 1})
        assert ok.status_code == 200, ok.text
        ok = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 2,
                                             "seed": -2**63, "top_k": -1})
        assert ok.status_code == 200, ok.text
    assert_idle(url)


def test_bad_numbers_beside_32_good_streams(url, tiny_llm):
    """A seed of 2**64 or a top_k of 10**12 among 32 concurrent good streams: the bad ones get
    a 400, each good one exactly its lone output."""
    lengths = [4 + i % 7 for i in range(32)]
    expected = references(tiny_llm, [(PROMPTS[i % len(PROMPTS)], n)
                                     for i, n in enumerate(lengths)])

    async def run() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            good = [stream_text(client, {"prompt": PROMPTS[i % len(PROMPTS)],
                                         "max_tokens": n, "temperature": 0, "ignore_eos": True})
                    for i, n in enumerate(lengths)]
            bad = [client.post("/v1/completions", json={"prompt": "x", **field})
                   for field in ({"seed": 2**64}, {"top_k": 10**12}, {"temperature": -1},
                                 {"logit_bias": {"99999999999": 1}})]
            results = await asyncio.gather(*good, *bad)
        for i, (text, chunks) in enumerate(results[:32]):
            assert chunks[-1] == "[DONE]"
            assert text == expected[(PROMPTS[i % len(PROMPTS)], lengths[i])]
        for r in results[32:]:
            assert_openai_error(r, 400)

    asyncio.run(run())
    assert_idle(url)


def test_the_core_admits_a_request_s_choices_together(tiny_llama_dir):
    """A core that may hold 2 running and 1 waiting requests: n=4 is refused whole with a 503
    that gives the server's limit, n=3 runs whole; the core holds nothing afterwards."""
    engine = AsyncLLM.from_args(str(tiny_llama_dir), max_waiting_requests=1,
                                **{**ENGINE_ARGS, "max_num_seqs": 2})
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "ignore_eos": True}
    try:
        with serve(engine, MODEL) as base, httpx.Client(base_url=base, timeout=60) as c:
            assert_openai_error(c.post("/v1/completions", json={**body, "n": 4}), 503,
                                "(0 requests running or waiting, at most 3)")
            r = c.post("/v1/completions", json={**body, "n": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12
            assert_idle(base)
    finally:
        engine.shutdown()


REQUEST_FIELDS = {
    "model": st.one_of(st.none(), st.just(MODEL), st.text(max_size=8)),
    "max_tokens": st.one_of(st.none(), st.integers(-2, 6), st.integers()),
    "n": st.integers(-1, 20), "temperature": st.one_of(st.none(), st.floats(-1, 3)),
    "top_p": st.floats(-0.5, 1.5), "top_k": st.integers(), "min_p": st.floats(-1, 2),
    "seed": st.integers(), "stop": st.one_of(st.none(), st.text(max_size=3),
                                             st.lists(st.text(max_size=3), max_size=3)),
    "logprobs": st.one_of(st.none(), st.integers(-1, 25), st.booleans()),
    "stream": st.booleans(), "echo": st.booleans(),
    "presence_penalty": st.floats(-3, 3), "repetition_penalty": st.floats(-1, 3),
    "logit_bias": st.dictionaries(st.text(max_size=4), st.floats(-200, 200), max_size=2),
    "stop_token_ids": st.lists(st.integers(), max_size=2), "min_tokens": st.integers(-1, 8),
    "top_logprobs": st.integers(-1, 25), "ignore_eos": st.booleans(),
    "tool_choice": st.sampled_from(["none", "auto", None]),
}
PROMPT = st.one_of(st.text(max_size=20), st.lists(st.integers(-5, 400), max_size=6),
                   st.lists(st.text(max_size=5), max_size=3), st.integers(), st.none())


@st.composite
def bodies(draw) -> tuple[str, dict]:
    chat = draw(st.booleans())
    fields = draw(st.fixed_dictionaries({}, optional=REQUEST_FIELDS))
    if chat:
        role = draw(st.sampled_from(["user", "system", "assistant", "robot"]))
        fields["messages"] = [{"role": role, "content": draw(st.text(max_size=20))}]
        fields.pop("echo", None)
        fields["max_tokens"] = draw(st.one_of(st.integers(-1, 8), st.just(2**40)))
        return "/v1/chat/completions", fields
    fields["prompt"] = draw(PROMPT)
    if isinstance(fields.get("max_tokens"), int) and fields["max_tokens"] > 8:
        fields["max_tokens"] = 8  # short outputs: the test's time goes into many bodies
    return "/v1/completions", fields


@pytest.fixture
def concurrent_good_stream(url, tiny_llm):
    """A stream that runs while a test throws other requests at the server; it must come out
    equal to its offline output."""
    import threading

    expected = reference(tiny_llm, PROMPTS[2], 200)
    got: list[str] = []

    def run() -> None:
        async def one() -> str:
            async with httpx.AsyncClient(base_url=url, timeout=300) as client:
                return (await stream_text(client, {"prompt": PROMPTS[2], "max_tokens": 200,
                                                   "temperature": 0, "ignore_eos": True}))[0]
        got.append(asyncio.run(one()))

    thread = threading.Thread(target=run)
    thread.start()
    yield
    thread.join()
    assert got == [expected]


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=bodies())
def test_any_body_gets_a_2xx_or_an_openai_4xx(url, concurrent_good_stream, case):
    path, body = case
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post(path, json=body)
    if r.status_code >= 400:
        assert 400 <= r.status_code < 500, (body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, r.text
    elif body.get("stream"):
        assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text


def test_64_streams_a_quarter_leaving(url, tiny_llm):
    """64 concurrent streams, 16 of whose clients leave mid-stream: every finished stream whole
    and equal to its prompt's offline output; the KV pool full and the running gauge at 0."""
    lengths = [6 + i % 11 for i in range(64)]
    expected = references(tiny_llm, [(PROMPTS[i % len(PROMPTS)], n)
                                     for i, n in enumerate(lengths)])

    async def run() -> None:
        limits = httpx.Limits(max_connections=80)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
            results = await asyncio.gather(*(
                stream_text(client, {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 200
                                     if i % 4 == 0 else n, "temperature": 0,
                                     "ignore_eos": True}, stop_after=2 if i % 4 == 0 else None)
                for i, n in enumerate(lengths)))
        for i, (text, chunks) in enumerate(results):
            if i % 4:
                assert chunks[-1] == "[DONE]"
                assert text == expected[(PROMPTS[i % len(PROMPTS)], lengths[i])]

    asyncio.run(run())
    assert_idle(url)


# ---- the `liteinfer serve` process ----------------------------------------------------------
def start_server(model_dir: Path, *flags: str, log: Path,
                 statuses: list[httpx.Response] | None = None) -> tuple[subprocess.Popen, str]:
    """`liteinfer serve` of the model on a port the kernel chooses, once /health answers 200;
    its output goes to `log`, and /health's answers before the 200 to `statuses`. (A port
    picked here and bound by the server later could be taken meanwhile by any other test's
    connection.)"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), *sys.path])}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "liteinfer.cli", "serve", "--model",
                                 str(model_dir), "--device", "cpu", "--dtype", "float32",
                                 "--max-model-len", "256", "--port", "0", *flags],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    base = None
    # Three processes importing torch on a loaded two-core machine can take minutes to serve.
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise AssertionError(log.read_text())
        if time.monotonic() > deadline:
            proc.terminate()  # it stops the processes it started, which a kill would orphan
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
            proc.kill()
            raise AssertionError("the server did not start")
        if base is None:
            found = LISTENING_URL.search(log.read_text())
            base = found and found[1]
            time.sleep(0.2)
            continue
        try:
            r = httpx.get(base + "/health")
        except httpx.TransportError:
            time.sleep(0.2)
            continue
        if r.status_code == 200:
            return proc, base
        if statuses is not None:
            statuses.append(r)
        time.sleep(0.2)


def core_pid(server_pid: int) -> int:
    """The engine core: the server's child running multiprocessing's spawn entry point."""
    (core,) = spawned_children(server_pid)
    return core


ESTABLISHED, LISTEN = psutil.CONN_ESTABLISHED, psutil.CONN_LISTEN


def sockets_per_process(pids: list[int], port: int, state: str = ESTABLISHED
                        ) -> dict[int, int]:
    """Each process's TCP sockets on local `port` in `state`. psutil skips a descriptor that
    closes while it walks the process's table, which a running server does at any moment."""
    return {pid: sum(bool(c.laddr) and c.laddr.port == port and c.status == state
                     for c in psutil.Process(pid).net_connections("tcp"))
            for pid in pids}


def spawned_children(server_pid: int) -> list[int]:
    """The server's children started by multiprocessing's spawn (the engine core, API
    servers)."""
    pids = []
    for child in psutil.Process(server_pid).children():
        with contextlib.suppress(psutil.NoSuchProcess):  # one that exited meanwhile
            if any("spawn_main" in arg for arg in child.cmdline()):
                pids.append(child.pid)
    return pids


def front_ends_and_core(server_pid: int, port: int) -> tuple[list[int], int]:
    """The API-server processes (those listening on the port) and the engine core."""
    children = spawned_children(server_pid)
    listening = sockets_per_process(children, port, LISTEN)
    front_ends = [p for p in children if listening[p]]
    (core,) = set(children) - set(front_ends)
    return front_ends, core


async def streams_in_flight(base: str, n: int, max_tokens: int, started: asyncio.Event
                            ) -> list[list]:
    """n streams; `started` is set once each has its first event."""
    first = [asyncio.Event() for _ in range(n)]

    async def one(client: httpx.AsyncClient, i: int) -> list:
        chunks = []
        body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens,
                "ignore_eos": True, "temperature": 0, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    payload = line[len("data: "):]
                    chunks.append(payload if payload == "[DONE]" else json.loads(payload))
                    first[i].set()
        return chunks

    async def all_started() -> None:
        for e in first:
            await e.wait()
        started.set()

    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        watcher = asyncio.ensure_future(all_started())
        results = await asyncio.gather(*(one(client, i) for i in range(n)))
        watcher.cancel()
    return results


def whole_or_error(chunks: list, max_tokens: int) -> str:
    """'whole' or 'error'; anything else (a silent cut) fails."""
    assert chunks and chunks[-1] == "[DONE]", chunks[-3:]
    if "error" in chunks[-2]:
        assert set(chunks[-2]["error"]) == {"message", "type", "param", "code"}
        return "error"
    tokens = sum(1 for c in chunks[:-1] if c["choices"][0]["finish_reason"] is None) + 1
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and tokens <= max_tokens
    return "whole"


def test_core_death_fails_streams_and_the_server_exits(tiny_llama_dir, tmp_path):
    proc, base = start_server(tiny_llama_dir, log=tmp_path / "serve.log")
    try:
        async def run() -> list[list]:
            started = asyncio.Event()
            task = asyncio.ensure_future(streams_in_flight(base, 4, 240, started))
            await asyncio.wait_for(started.wait(), 60)
            os.kill(core_pid(proc.pid), signal.SIGKILL)
            return await task

        results = asyncio.run(run())
        assert [whole_or_error(c, 240) for c in results] == ["error"] * 4
        assert proc.wait(timeout=15) != 0
    finally:
        proc.kill()
        proc.wait()


def test_sigterm_drains_then_exits(tiny_llama_dir, tmp_path):
    """Short streams finish within the grace period; long ones finish or get an error event."""
    grace = 2.0
    proc, base = start_server(tiny_llama_dir, "--shutdown-grace", str(grace),
                              log=tmp_path / "serve.log")
    try:
        async def run() -> tuple[list[list], int, float]:
            started = asyncio.Event()
            short = asyncio.ensure_future(streams_in_flight(base, 2, 4, asyncio.Event()))
            long = asyncio.ensure_future(streams_in_flight(base, 3, 240, started))
            await asyncio.wait_for(started.wait(), 60)
            proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            await asyncio.sleep(0.2)
            async with httpx.AsyncClient(base_url=base) as client:
                try:
                    refused = (await client.post("/v1/completions", json={"prompt": "x"}))
                    status = refused.status_code
                except httpx.TransportError:
                    status = 503  # the listening socket may already be closed
            results = await short + await long
            return results, status, sent

        results, status, sent = asyncio.run(run())
        assert status == 503
        kinds = [whole_or_error(c, 240) for c in results]
        assert kinds[:2] == ["whole"] * 2
        proc.wait(timeout=grace + 5)
        assert time.monotonic() - sent < grace + 5
    finally:
        proc.kill()
        proc.wait()


def test_tokenization_never_blocks_the_event_loop(url, core, monkeypatch):
    """A prompt that takes 2 s to tokenize (as a huge one does): /health and another request
    are answered meanwhile. Tokenizing on the event loop held /health for 8-37 s."""
    from concurrent.futures import ThreadPoolExecutor

    tokenize = core.processor.tokenize

    def slow(text: str, *args, **kwargs):
        if text == "slow to tokenize":
            time.sleep(2.0)
        return tokenize(text, *args, **kwargs)

    monkeypatch.setattr(core.processor, "tokenize", slow)
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0}
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, url + "/v1/completions",
                              json={**body, "prompt": "slow to tokenize"}, timeout=30)
        time.sleep(0.3)  # the slow request is being tokenized now
        start = time.monotonic()
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        other = httpx.post(url + "/v1/completions", json={**body, "prompt": "x"}, timeout=30)
        assert other.status_code == 200, other.text
        assert time.monotonic() - start < 1.5
        assert not pending.done()
        assert pending.result().status_code == 200
    assert_idle(url)


def test_serve_engine_shuts_the_engine_down_when_an_override_fails():
    """An override the model cannot take (a chat template without a tokenizer) is the
    command's error, and the engine (its core process) is shut down, not left running."""
    from liteinfer.entrypoints.openai.api_server import serve_engine
    from liteinfer.entrypoints.openai.cli_args import ServerArgs
    from liteinfer.loader.overrides import ModelOverrides

    class Engine:
        tokenizer = generation_config = dead = None
        shut_down = False

        def shutdown(self) -> None:
            self.shut_down = True

    engine = Engine()
    with pytest.raises(ValueError, match="no tokenizer"):
        serve_engine(engine, "m", ServerArgs(), ModelOverrides(chat_template="{{ x }}"),
                     "127.0.0.1", 0)
    assert engine.shut_down
