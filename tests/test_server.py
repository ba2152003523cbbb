"""The OpenAI-compatible server over real HTTP (uvicorn on a local port) against the offline
LLM on the same tiny model: same tokens under greedy decoding, streamed or whole, alone or
batched with other requests; bad input answered with a 400 that leaves running requests alone;
disconnected clients' requests aborted."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import liteinfer
from fixtures import serve
from liteinfer import SamplingParams
from liteinfer.config import EngineConfig
from liteinfer.engine.async_llm import AsyncLLM
from liteinfer.entrypoints.openai import api_server, serving
from liteinfer.entrypoints.openai.cli_args import ServerArgs

MODEL = "tiny"
PROMPTS = ["The quick brown fox", "Hello world! How are", "Once upon a time there",
           "def add(a, b):"]


ENGINE_ARGS = dict(dtype="float32", device="cpu", max_model_len=256)


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    """(base URL, AsyncLLM): the tiny model served as the `tiny_llm` fixture is built, by an
    engine core that has room for a second front end (client index 1)."""
    engine = AsyncLLM.from_args(str(tiny_llama_dir), num_clients=2, **ENGINE_ARGS)
    with serve(engine, MODEL) as url:
        yield url, engine
        assert_engine_idle(url)
    engine.shutdown()


def assert_engine_idle(url: str) -> None:
    """The core holds no request and every KV block is back in its pool (as its last step
    message reported)."""
    with httpx.Client(base_url=url) as c:
        deadline = time.monotonic() + 10
        while True:
            m = scrape(c)
            idle = (m["liteinfer:num_requests_running"] == m["liteinfer:num_requests_waiting"]
                    == m["liteinfer:kv_cache_usage_perc"] == 0)
            if idle:
                return
            assert time.monotonic() < deadline, f"the engine is not idle: {m}"
            time.sleep(0.05)


def second_front_end(served, tiny_llama_dir) -> AsyncLLM:
    """Another front end of the module's engine core."""
    return AsyncLLM(str(tiny_llama_dir), EngineConfig(**ENGINE_ARGS), served[1].core_handle,
                    client_index=1)


@pytest.fixture
def client(served):
    with httpx.Client(base_url=served[0], timeout=60) as c:
        yield c


def offline(llm, prompts, **params):
    return [o.outputs[0] for o in llm.generate(prompts, SamplingParams(**params), use_tqdm=False)]


def events(response: httpx.Response) -> list:
    """The data payloads of a server-sent event stream, [DONE] included as a string."""
    out = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    return [p if p == "[DONE]" else json.loads(p) for p in out]


def test_models_and_health(client):
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 256
    assert client.get(f"/v1/models/{MODEL}").json() == models["data"][0]
    missing = client.get("/v1/models/no-such-model")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
    assert client.get("/version").json() == {"version": liteinfer.__version__}
    unknown = client.get("/v1/no-such-route")
    assert unknown.status_code == 404 and "error" in unknown.json()


def test_completions_match_offline_greedy(client, tiny_llm):
    ref = offline(tiny_llm, PROMPTS, temperature=0.0, max_tokens=12)
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS, "max_tokens": 12,
                                              "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert [c["index"] for c in body["choices"]] == list(range(len(PROMPTS)))
    assert [c["text"] for c in body["choices"]] == [c.text for c in ref]
    assert [c["finish_reason"] for c in body["choices"]] == [c.finish_reason for c in ref]
    prompt_tokens = sum(len(tiny_llm.tokenizer.encode(p)) for p in PROMPTS)
    completion_tokens = sum(len(c.token_ids) for c in ref)
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    # A prompt given as token ids is the same request.
    ids = tiny_llm.tokenizer.encode(PROMPTS[0])
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 12, "temperature": 0})
    assert r.json()["choices"][0]["text"] == ref[0].text


def test_chat_matches_offline_greedy(client, tiny_llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    ref = tiny_llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                   "max_completion_tokens": 10, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": ref[0].outputs[0].text}
    assert choice["finish_reason"] == ref[0].outputs[0].finish_reason
    # Content given as text parts renders the same conversation.
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in messages]
    r = client.post("/v1/chat/completions", json={"messages": parts, "max_tokens": 10,
                                                   "temperature": 0})
    assert r.json()["choices"][0]["message"]["content"] == ref[0].outputs[0].text


@pytest.mark.parametrize("chat", [False, True])
def test_stream_equals_whole_response(client, chat):
    path, body = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})
                  if chat else ("/v1/completions", {"prompt": PROMPTS[:2]}))
    body.update(max_tokens=16, temperature=0.8, seed=3, n=2, stop=[" the"])
    whole = client.post(path, json=body).json()
    with client.stream("POST", path, json={**body, "stream": True,
                                           "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = events(r)
    # The same prompt again: with prefix caching (the default) its KV may now come cached.
    usage = {**chunks[-2]["usage"], "prompt_tokens_details": whole["usage"].get(
        "prompt_tokens_details")}
    assert chunks[-1] == "[DONE]" and usage == whole["usage"]
    texts, reasons = {}, {}
    for chunk in chunks[:-2]:
        (choice,) = chunk["choices"]
        delta = choice["delta"].get("content", "") if chat else choice["text"]
        texts[choice["index"]] = texts.get(choice["index"], "") + delta
        reasons[choice["index"]] = choice["finish_reason"] or reasons.get(choice["index"])
    if chat:
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    for c in whole["choices"]:
        assert texts[c["index"]] == (c["message"]["content"] if chat else c["text"])
        assert reasons[c["index"]] == c["finish_reason"]


def test_concurrent_requests_each_match_offline(client, tiny_llm):
    lengths = [5, 17, 9, 30, 12, 24]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(lengths))]
    ref = [offline(tiny_llm, [p], temperature=0.0, max_tokens=n, ignore_eos=True)[0].text
           for p, n in zip(prompts, lengths)]

    def ask(i: int) -> str:
        r = client.post("/v1/completions", json={"prompt": prompts[i], "max_tokens": lengths[i],
                                                  "temperature": 0, "ignore_eos": True})
        return r.json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(lengths)) as pool:
        assert list(pool.map(ask, range(len(lengths)))) == ref


def test_logit_bias_matches_offline(client, tiny_llm):
    """A bias of +100 forces its token; one of -100 bans the greedy choice."""
    first = offline(tiny_llm, [PROMPTS[0]], temperature=0.0, max_tokens=1)[0].token_ids[0]
    for bias in ({"7": 100.0}, {str(first): -100.0, "9": 0.5}):
        ref = offline(tiny_llm, [PROMPTS[0]], temperature=0.0, max_tokens=6, ignore_eos=True,
                      logit_bias={int(k): v for k, v in bias.items()})[0]
        r = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 6,
                                                  "temperature": 0, "ignore_eos": True,
                                                  "logit_bias": bias})
        assert r.json()["choices"][0]["text"] == ref.text
    assert ref.token_ids[0] != first
    forced = offline(tiny_llm, [PROMPTS[0]], temperature=0.0, max_tokens=6, ignore_eos=True,
                     logit_bias={7: 100.0})[0]
    assert forced.token_ids == [7] * 6


def scrape(client) -> dict[str, float]:
    """The server's liteinfer samples by name and labels (histograms by _count and _sum)."""
    from prometheus_client.parser import text_string_to_metric_families

    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items())
                             if k != "model_name"): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples
            if s.name.startswith("liteinfer:")}


@pytest.mark.parametrize("stream", [False, True])
def test_metrics_count_what_clients_receive(client, stream):
    before = scrape(client)
    body = {"prompt": PROMPTS[:2], "max_tokens": 5, "n": 2, "temperature": 0.7, "seed": 1,
            "ignore_eos": True, "stream": stream, "stream_options": {"include_usage": True}}
    r = client.post("/v1/completions", json=body)
    usage = (events(r)[-2] if stream else r.json())["usage"]
    after = scrape(client)
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    # Each of the n choices is an engine request that counts its prompt.
    assert delta["liteinfer:prompt_tokens_total"] == 2 * usage["prompt_tokens"]
    assert delta["liteinfer:generation_tokens_total"] == usage["completion_tokens"] == 20
    assert delta["liteinfer:request_success_total,finished_reason=length"] == 4
    assert delta["liteinfer:time_to_first_token_seconds_count"] == 4
    assert delta["liteinfer:e2e_request_latency_seconds_count"] == 4
    # Four tokens after each request's first, whether they came one or several at a time.
    assert delta["liteinfer:inter_token_latency_seconds_count"] == 16
    assert delta["liteinfer:request_time_per_output_token_seconds_count"] == 4
    # The core's counters, as its step messages report them (prefix caching is on).
    assert after["liteinfer:prefix_cache_queries_total"] > 0
    assert 0 <= after["liteinfer:prefix_cache_hits_total"] <= after[
        "liteinfer:prefix_cache_queries_total"]
    assert after["liteinfer:num_preemptions_total"] >= 0
    assert 0 < delta["liteinfer:time_to_first_token_seconds_sum"] <= delta[
        "liteinfer:e2e_request_latency_seconds_sum"]
    assert after["liteinfer:num_requests_running"] == after["liteinfer:num_requests_waiting"] == 0


def test_echo_returns_the_prompt_and_its_logprobs(client, tiny_llm):
    """echo with logprobs and max_tokens 1, as evaluation harnesses score a text."""
    ids = tiny_llm.tokenizer.encode(PROMPTS[3])
    ref = tiny_llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, logprobs=2,
                                                  prompt_logprobs=2), use_tqdm=False)[0]
    body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 2, "echo": True}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    prompt_text = tiny_llm.tokenizer.decode(ids)
    assert choice["text"] == prompt_text + ref.outputs[0].text
    lp = choice["logprobs"]
    token_ids = ids + ref.outputs[0].token_ids
    assert len(lp["tokens"]) == len(token_ids) and lp["token_logprobs"][0] is None
    entries = ref.prompt_logprobs[1:] + ref.outputs[0].logprobs
    assert lp["token_logprobs"][1:] == [e[t].logprob for t, e in zip(token_ids[1:], entries)]
    assert lp["top_logprobs"][0] is None
    assert all(1 <= len(top) <= 3 for top in lp["top_logprobs"][1:])  # keyed by text
    # Streamed, the first chunk carries the prompt; without logprobs, text alone is echoed.
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = events(r)[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    plain = client.post("/v1/completions", json={"prompt": PROMPTS[3], "max_tokens": 4,
                                                 "temperature": 0, "echo": True}).json()
    text = offline(tiny_llm, [PROMPTS[3]], temperature=0.0, max_tokens=4)[0].text
    assert plain["choices"][0]["text"] == PROMPTS[3] + text
    assert plain["choices"][0]["logprobs"] is None


def test_tokenize_and_detokenize(client, tiny_llm):
    text = PROMPTS[1]
    r = client.post("/tokenize", json={"prompt": text}).json()
    ids = tiny_llm.tokenizer.encode(text)
    assert r == {"tokens": ids, "count": len(ids), "max_model_len": 256}
    used = client.post("/v1/completions", json={"prompt": text, "max_tokens": 1}).json()
    assert used["usage"]["prompt_tokens"] == r["count"]
    messages = [{"role": "user", "content": "Hello!"}]
    r = client.post("/tokenize", json={"messages": messages}).json()
    assert r["tokens"] == tiny_llm.apply_chat_template(messages)
    r = client.post("/detokenize", json={"tokens": ids}).json()
    assert r == {"prompt": tiny_llm.tokenizer.decode(ids)}
    for path, body, needle in [("/tokenize", {"prompt": "x", "messages": messages}, "either"),
                               ("/tokenize", {}, "either"),
                               ("/detokenize", {"tokens": [5, 10 ** 6]}, "vocabulary"),
                               ("/detokenize", {"tokens": "abc"}, "tokens")]:
        r = client.post(path, json=body)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert client.post("/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404


@pytest.mark.parametrize("metrics_need_key", [False, True])
def test_api_key_guards_the_api(served, tiny_llama_dir, metrics_need_key):
    """Every route touching the model or its tokenizer needs the key; /health and /livez
    never do."""
    front = second_front_end(served, tiny_llama_dir)
    args = ServerArgs(api_key="s3cret", metrics_need_key=metrics_need_key)
    with serve(front, MODEL, args) as url, httpx.Client(base_url=url) as c:
        body = {"prompt": "x", "max_tokens": 2, "ignore_eos": True}  # sampled: EOS could end it
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = c.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        for method, path, payload in [("GET", "/v1/models", None),
                                      ("POST", "/v1/chat/completions", {"messages": []}),
                                      ("POST", "/tokenize", {"prompt": "x"}),
                                      ("POST", "/detokenize", {"tokens": [5]}),
                                      ("GET", "/nowhere", None)]:
            assert c.request(method, path, json=payload).status_code == 401, path
        assert c.get("/health").status_code == c.get("/livez").status_code == 200
        assert c.get("/metrics").status_code == (401 if metrics_need_key else 200)
        r = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        r = c.post("/tokenize", json={"prompt": "x"}, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200
    front.shutdown()


def test_serve_command_takes_the_api_key_and_limits(monkeypatch):
    from liteinfer import cli

    calls = []
    monkeypatch.setattr(api_server, "run_server", lambda *a, **kw: calls.append(a[5]))
    cli.main(["serve", "--api-key", "k1", "--max-waiting-requests", "7"])
    monkeypatch.setenv("LITEINFER_API_KEY", "k2")
    cli.main(["serve", "--shutdown-grace", "1.5", "--metrics-need-key"])
    cli.main(["serve", "--api-key", "k3", "--max-body-bytes", "100"])
    assert [a.api_key for a in calls] == ["k1", "k2", "k3"]
    assert calls[0].max_waiting_requests == 7 and calls[1].shutdown_grace_s == 1.5
    assert calls[1].metrics_need_key and calls[2].max_body_bytes == 100


def test_seeded_choices_are_reproducible(client):
    body = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 1.0, "seed": 7, "n": 3}
    first, second = (client.post("/v1/completions", json=body).json() for _ in range(2))
    texts = [c["text"] for c in first["choices"]]
    assert texts == [c["text"] for c in second["choices"]]
    assert len(set(texts)) > 1  # each choice draws from its own seed
    greedy = client.post("/v1/completions", json={**body, "temperature": 0}).json()
    assert len({c["text"] for c in greedy["choices"]}) == 1


def test_logprobs_match_offline(client, tiny_llm):
    (ref,) = offline(tiny_llm, [PROMPTS[1]], temperature=0.0, max_tokens=6, logprobs=2)
    r = client.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 6,
                                              "temperature": 0, "logprobs": 2}).json()
    lp = r["choices"][0]["logprobs"]
    sampled = [e[t].logprob for t, e in zip(ref.token_ids, ref.logprobs)]
    assert lp["token_logprobs"] == pytest.approx(sampled)
    for served_top, ref_top in zip(lp["top_logprobs"], ref.logprobs, strict=True):
        expected = sorted(v.logprob for v in ref_top.values())
        assert sorted(served_top.values()) == pytest.approx(expected)
    tokens = [tiny_llm.tokenizer.decode([t]) for t in ref.token_ids]
    assert lp["tokens"] == tokens  # the stop token too, though the text leaves it out
    assert lp["text_offset"] == [sum(map(len, tokens[:i])) for i in range(len(tokens))]
    chat = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0,
        "logprobs": True, "top_logprobs": 2}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(len(c["top_logprobs"]) == 2 for c in content)
    assert all(c["top_logprobs"][0]["logprob"] == pytest.approx(c["logprob"]) for c in content)


BAD = [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1000}, "max_model_len"),
    ("/v1/completions", {"prompt": [5, 100000]}, "vocabulary"),
    ("/v1/completions", {"prompt": ["fine", ""]}, "empty"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"five": 1.0}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"100000": 1.0}}, "vocabulary"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "text content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{}]},
     "tools"),
]


def test_bad_requests_get_400_and_leave_others_running(client, served, tiny_llm):
    ref = offline(tiny_llm, [PROMPTS[2]], temperature=0.0, max_tokens=60, ignore_eos=True)[0]
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(client.post, "/v1/completions", json={
            "prompt": PROMPTS[2], "max_tokens": 60, "temperature": 0, "ignore_eos": True})
        for path, body, needle in BAD:
            r = client.post(path, json=body)
            assert r.status_code == 400, (body, r.text)
            error = r.json()["error"]
            assert error["code"] == 400 and needle in error["message"], error
        r = client.post("/v1/completions", json={"model": "other", "prompt": "x"})
        assert r.status_code == 404 and "does not exist" in r.json()["error"]["message"]
        assert running.result().json()["choices"][0]["text"] == ref.text
    # Nothing of the rejected multi-prompt request was admitted.
    assert served[1].num_requests == 0
    assert_engine_idle(served[0])


@pytest.mark.parametrize("stream", [True, False])
def test_disconnected_client_is_aborted(served, stream, monkeypatch):
    url, engine = served
    monkeypatch.setattr(serving, "DISCONNECT_POLL_S", 0.02)  # well within the 240 tokens
    aborted: list[list[str]] = []
    abort = engine.abort
    monkeypatch.setattr(engine, "abort", lambda ids: aborted.append(ids) or abort(ids))
    # What /metrics keeps of a request (its last token's time) is dropped when it is aborted.
    forgotten: list[str] = []
    forget = serving.ServerMetrics.forget
    monkeypatch.setattr(serving.ServerMetrics, "forget",
                        lambda self, ids: forgotten.extend(ids) or forget(self, ids))
    body = {"prompt": PROMPTS[3], "max_tokens": 240, "ignore_eos": True, "stream": stream}
    with httpx.Client(base_url=url, timeout=60) as c:
        if stream:
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
        else:
            with pytest.raises(httpx.ReadTimeout):
                c.post("/v1/completions", json=body, timeout=0.1)
    deadline = time.monotonic() + 20
    while engine.num_requests or not aborted:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.05)
    assert [len(ids) for ids in aborted] == [1]  # aborted while it ran, not after finishing
    assert forgotten == aborted[0]
    assert_engine_idle(url)


def test_openai_sdk_client(served, tiny_llm):
    """The official client library parses every response shape the server sends."""
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=served[0] + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "Hello!"}]
    ref = tiny_llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                           temperature=0)
    assert reply.choices[0].message.content == ref[0].outputs[0].text
    assert reply.usage.completion_tokens == len(ref[0].outputs[0].token_ids)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        ref[0].outputs[0].text
    assert chunks[-1].usage.total_tokens == reply.usage.total_tokens
    completion = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5,
                                           temperature=0, logprobs=1)
    assert len(completion.choices[0].logprobs.token_logprobs) == 5
    with pytest.raises(BadRequestError, match="top_p"):
        client.completions.create(model=MODEL, prompt="x", top_p=0)
