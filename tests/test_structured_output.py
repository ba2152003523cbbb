"""Structured outputs in the engine, offline, on the tiny random model (whose raw outputs are
noise, so everything it produces that parses is the grammar's doing): outputs match their JSON
schema, regex or choice; every sampled token is one xgrammar's own matcher allows, replayed
from the start; the bitmask the manager fills equals xgrammar's; unconstrained requests in the
same batch keep the tokens they get alone; invalid constraints are a ValueError."""
from __future__ import annotations

import json
import re
import time
from enum import StrEnum

import pytest
import torch
import xgrammar as xgr
from pydantic import BaseModel, Field

from liteinfer import SamplingParams
from liteinfer.structured_output import StructuredOutputsParams
from liteinfer.structured_output.backend import XgrammarBackend, tokenizer_info
from liteinfer.structured_output.manager import (
    ALLOWED,
    FORBIDDEN,
    TERMINATED,
    StructuredOutputManager,
)


class Color(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


# Strings are bounded by patterns: xgrammar 0.2.9's maxLength strings admit raw control
# characters, which JSON forbids.
class Item(BaseModel):
    name: str = Field(pattern=r"^[a-z]{1,6}$")
    qty: int = Field(ge=0, le=99)


class Order(BaseModel):
    color: Color
    items: list[Item] = Field(min_length=1, max_length=3)
    rush: bool
    note: str | None = Field(None, pattern=r"^[A-Z][a-z ]{0,4}$")


class Point(BaseModel):
    x: int = Field(ge=-9, le=9)
    y: int = Field(ge=-9, le=9)


class Path(BaseModel):
    start: Point
    end: Point
    tags: list[Color] = Field(max_length=2)


def generate(llm, prompts, constraint: StructuredOutputsParams, **params):
    params = SamplingParams(**{"max_tokens": 120, **params}, structured_outputs=constraint)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def replay(llm, constraint: StructuredOutputsParams, token_ids: list[int]) -> xgr.GrammarMatcher:
    """A fresh xgrammar matcher for `constraint` that has accepted `token_ids`, each checked."""
    engine = llm.engine
    backend = XgrammarBackend(tokenizer_info(engine.tokenizer, engine.model_config.vocab_size,
                                             engine.core.eos_token_ids))
    matcher = xgr.GrammarMatcher(backend.compile(constraint))
    for i, t in enumerate(token_ids):
        assert matcher.accept_token(t), f"token {i} ({t}) is not one the grammar allows"
    return matcher


@pytest.mark.parametrize("model", [Order, Path])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(tiny_llm, model, temperature):
    constraint = StructuredOutputsParams(json=model.model_json_schema(),
                                         disable_any_whitespace=True)
    outs = generate(tiny_llm, ["The quick brown fox", "Hello world"], constraint,
                    temperature=temperature, seed=3)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        model.model_validate_json(out.text)
        # The grammar's end is a stop token: the output ends with it, and the matcher too.
        assert out.token_ids[-1] in tiny_llm.engine.core.eos_token_ids
        assert replay(tiny_llm, constraint, out.token_ids).is_terminated()


def test_json_object_regex_and_choice(tiny_llm):
    obj = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    regex = StructuredOutputsParams(regex=r"[a-c]{2,5}-\d\d")
    choice = StructuredOutputsParams(choice=["Paris", "London", "New \"York\""])
    for constraint in (regex, choice):
        for out in generate(tiny_llm, ["The quick", "Once upon", "Hello"], constraint,
                            temperature=1.0, seed=5):
            assert out.finish_reason == "stop"
            if constraint is regex:
                assert re.fullmatch(r"[a-c]{2,5}-\d\d", out.text), out.text
            else:
                assert out.text in choice.choice
            replay(tiny_llm, constraint, out.token_ids)
    for out in generate(tiny_llm, ["The quick"], obj, max_tokens=200):
        # Any JSON object; noise rarely closes one within the limit, so only check the prefix.
        assert out.text.startswith("{")
        replay(tiny_llm, obj, out.token_ids)
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)


def test_grammar_constraint(tiny_llm):
    ebnf = 'root ::= "(" item (", " item)* ")"\nitem ::= [0-9] | "x"'
    constraint = StructuredOutputsParams(grammar=ebnf)
    for out in generate(tiny_llm, ["Numbers:", "The"], constraint, temperature=1.0, seed=1,
                        max_tokens=60):
        assert re.fullmatch(r"\(([0-9x])(, [0-9x])*\)?", out.text) or \
            re.fullmatch(r"\(([0-9x])(, [0-9x])*(, )?", out.text), out.text
        replay(tiny_llm, constraint, out.token_ids)


def test_rows_are_independent(tiny_llm):
    """Greedy: unconstrained requests batched with constrained ones get the tokens they get
    alone, and constrained ones the tokens they get alone; with penalties (each step read
    back before the next instead of overlapped) outputs still validate."""
    prompts = ["The quick brown fox", "Hello world! How are", "Once upon a time there"]
    free = SamplingParams(temperature=0.0, max_tokens=24)
    constraint = StructuredOutputsParams(json=Path.model_json_schema(),
                                         disable_any_whitespace=True)
    held = SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=constraint)

    def tokens(outs):
        return [o.outputs[0].token_ids for o in outs]

    alone = tokens(tiny_llm.generate(prompts, free, use_tqdm=False))
    held_alone = tokens(tiny_llm.generate(prompts, held, use_tqdm=False))
    mixed = tiny_llm.generate(prompts + prompts, [free] * 3 + [held] * 3, use_tqdm=False)
    assert tokens(mixed) == alone + held_alone
    penalized = SamplingParams(temperature=0.0, max_tokens=120, repetition_penalty=1.3,
                               structured_outputs=constraint)
    for o in tiny_llm.generate(prompts, penalized, use_tqdm=False):
        Path.model_validate_json(o.outputs[0].text)
        replay(tiny_llm, constraint, o.outputs[0].token_ids)


def test_constrained_steps_sample_in_the_next_call_before_the_next_launch(tiny_llm):
    """A step that samples for a constrained request is launched unsampled; the next step()
    samples it (every earlier step read, so the bitmask covers every token) and only then
    launches the step after it, so a forward pass is always queued. Still one token a call."""
    engine = tiny_llm.engine
    runner = engine.core.runner
    constraint = StructuredOutputsParams(json=Path.model_json_schema(),
                                         disable_any_whitespace=True)
    # Compiled first (and cached), so that no call below only waits for the grammar: alone,
    # this test would otherwise count the calls made while it compiles.
    generate(tiny_llm, ["Path:"], constraint, max_tokens=1)
    events: list[tuple[str, int]] = []
    call = 0
    forward, sample, execute = runner.forward, runner.sample, runner.execute

    def traced(name, fn):
        def run(staged, *args):
            events.append((name, call))
            if name == "sample":  # every earlier step read: its token is in the grammar
                seqs = engine.core.scheduler.requests
                assert [seqs[s.req_id].num_pending for s in staged.batch.sampling_seqs] == [1]
            return fn(staged, *args)
        return run

    runner.forward, runner.sample = traced("forward", forward), traced("sample", sample)
    runner.execute = traced("execute", execute)
    try:
        engine.add_request("held", "Path:", SamplingParams(temperature=0.0, max_tokens=12,
                                                            structured_outputs=constraint))
        tokens = []
        while engine.has_unfinished_requests():
            call += 1
            tokens += [t for o in engine.step() for t in o.new_token_ids]
    finally:
        runner.forward, runner.sample, runner.execute = forward, sample, execute
    assert not any(name == "execute" for name, _ in events)
    forwards = [c for name, c in events if name == "forward"]
    samples = [c for name, c in events if name == "sample"]
    assert forwards == list(range(1, len(forwards) + 1))  # one launch a call
    assert samples == [c + 1 for c in forwards]  # each sampled in the next call
    order = [name for name, _ in events]
    assert order == ["forward"] + ["sample", "forward"] * (len(forwards) - 1) + ["sample"]
    assert (len(tokens), call) == (len(forwards), len(forwards) + 1)
    replay(tiny_llm, constraint, tokens)


def wait_ready(manager: StructuredOutputManager, request_ids) -> None:
    deadline = time.monotonic() + 60
    while True:
        manager.poll()
        if all(manager.is_ready(r) for r in request_ids):
            return
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_manager_bitmask_equals_xgrammar(tiny_llm):
    """The grammar process's bitmask rows equal xgrammar's own matcher's, whether they were
    filled on demand or while the caller went on (`advance` given the next step's rows); the
    statuses of accepted, forbidden and final tokens."""
    engine = tiny_llm.engine
    vocab = engine.model_config.vocab_size
    eos = engine.core.eos_token_ids
    manager = StructuredOutputManager(engine.tokenizer, vocab, eos, max_rows=4)
    a = StructuredOutputsParams(json=Order.model_json_schema())
    b = StructuredOutputsParams(regex=r"(ab|cd)+")
    manager.add_request("a", a)
    manager.add_request("b", b)
    manager.add_request("a2", StructuredOutputsParams(json=Order.model_json_schema()))
    wait_ready(manager, ("a", "b", "a2"))
    assert manager.error("a") is None
    assert len(manager._grammars) == 2  # the same schema compiles once
    backend = XgrammarBackend(tokenizer_info(engine.tokenizer, vocab, eos))
    refs = {"a": xgr.GrammarMatcher(backend.compile(a)),
            "b": xgr.GrammarMatcher(backend.compile(b))}
    steps = {"a": ['{"', 'color', '":', ' "', 'red'], "b": ["a", "b", "c"]}
    rows = [None, "a", "unconstrained", "b"]
    for i in range(3):
        mask = manager.grammar_bitmask(rows)
        assert mask.rows == [1, 3]
        assert (mask.bitmask[[0, 2]] == -1).all()  # unconstrained rows allow every token
        for row, rid in ((1, "a"), (3, "b")):
            want = xgr.allocate_token_bitmask(1, vocab)
            refs[rid].fill_next_token_bitmask(want)
            assert torch.equal(mask.bitmask[row], want[0])
        accepts = [(rid, engine.tokenizer.encode(steps[rid][i], add_special_tokens=False))
                   for rid in ("a", "b")]
        # Every other step, the next rows are filled ahead.
        next_rows = [(1, "a"), (3, "b")] if i % 2 == 0 else []
        manager.advance(accepts, next_rows)
        assert manager.accepted() == [ALLOWED, ALLOWED]
        for rid, token in accepts:
            for t in token:
                assert refs[rid].accept_token(t)
    bad = engine.tokenizer.encode("zzz", add_special_tokens=False)
    manager.advance([("b", bad), ("a2", bad)])  # statuses never read: the next call's are
    for accepts, statuses in (([("b", bad)], [FORBIDDEN]),
                              ([("b", engine.tokenizer.encode("d", add_special_tokens=False)),
                                ("a2", bad)], [ALLOWED, FORBIDDEN]),
                              ([("b", [eos[0]])], [TERMINATED])):
        manager.advance(accepts)
        assert manager.accepted() == statuses
    for rid in ("a", "b", "a2"):
        manager.finish_request(rid)
    assert manager.grammar_bitmask(["a", "b"]) is None
    manager.shutdown()


def test_compiled_grammars_are_evicted_least_recently_used_first(tiny_llm):
    engine = tiny_llm.engine
    manager = StructuredOutputManager(engine.tokenizer, engine.model_config.vocab_size,
                                      engine.core.eos_token_ids, max_rows=2, cache_size=2)
    keys = [StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+")]
    manager.add_request("1", keys[0])
    manager.add_request("2", keys[1])
    manager.add_request("3", keys[0])  # a hit: "a+" is now the most recent
    manager.add_request("4", keys[2])  # evicts "b+"
    assert list(manager._grammars) == [keys[0].key, keys[2].key]
    wait_ready(manager, "1234")
    # An evicted grammar's request keeps its matcher.
    assert manager.grammar_bitmask(["2"]).rows == [0]
    b = engine.tokenizer.encode("b", add_special_tokens=False)
    manager.advance([("2", b)])
    assert manager.accepted() == [ALLOWED]
    manager.shutdown()


def test_the_grammar_process_fills_rows_and_allows_every_token_in_the_others(tiny_llm):
    """The grammar process over its pipe: each STEP leaves its constrained rows as xgrammar's
    own matcher fills them and its other rows allowing every token, as the rows change roles
    from step to step; rows that already allow every token are not written again."""
    import threading
    from multiprocessing import Pipe

    import msgspec

    from liteinfer.structured_output import worker
    from liteinfer.structured_output.worker import GrammarWorker

    engine = tiny_llm.engine
    vocab = engine.model_config.vocab_size
    info = tokenizer_info(engine.tokenizer, vocab, engine.core.eos_token_ids)
    words = xgr.get_bitmask_shape(1, vocab)[1]
    bitmask = torch.zeros(3, words, dtype=torch.int32)
    ours, theirs = Pipe()
    grammar_worker = GrammarWorker(theirs, info.serialize_json(), bitmask, fill_threads=1,
                                   compile_threads=1, spin=False)
    thread = threading.Thread(target=grammar_worker.run, daemon=True)
    thread.start()
    params = StructuredOutputsParams(regex="(ab)+")

    def ask(message: list) -> list:
        ours.send_bytes(msgspec.msgpack.encode(message))
        return msgspec.msgpack.decode(ours.recv_bytes())

    ours.send_bytes(msgspec.msgpack.encode(worker.params_message(0, params)))
    ours.send_bytes(msgspec.msgpack.encode([worker.ADD, "r", 0]))
    deadline = time.monotonic() + 60
    while ask([worker.POLL])[-1] != [[0, None]]:
        assert time.monotonic() < deadline
    reference = xgr.GrammarMatcher(XgrammarBackend(info).compile(params))
    expected = xgr.allocate_token_bitmask(1, vocab)
    reference.fill_next_token_bitmask(expected, 0)
    everything = torch.full((words,), -1, dtype=torch.int32)

    assert ask([worker.STEP, [], [[0, "r"]], [1, 2]])[0] == worker.FILLED
    assert torch.equal(bitmask[0], expected[0])
    assert torch.equal(bitmask[1], everything) and torch.equal(bitmask[2], everything)
    bitmask[2, 0] = 7  # row 2 allows every token already: the next step leaves it as it is

    token = engine.tokenizer.encode("a", add_special_tokens=False)[0]
    assert reference.accept_token(token)
    reference.fill_next_token_bitmask(expected, 0)
    assert ask([worker.STEP, [["r", [token]]], [[1, "r"]], [0, 2]])[1] == [worker.ALLOWED]
    assert ours.poll(60)
    assert msgspec.msgpack.decode(ours.recv_bytes())[0] == worker.FILLED
    assert torch.equal(bitmask[1], expected[0])
    assert torch.equal(bitmask[0], everything)
    assert bitmask[2, 0] == 7

    assert ask([worker.STEP, [], [[0, "r"]], [1, 2]])[0] == worker.FILLED  # row 1 was filled
    assert torch.equal(bitmask[0], expected[0]) and torch.equal(bitmask[1], everything)
    ours.send_bytes(msgspec.msgpack.encode([worker.SHUTDOWN]))
    thread.join(10)
    assert not thread.is_alive()


def test_a_request_finished_while_its_grammar_compiles_gets_no_matcher(tiny_llm):
    """The grammar process's side: a request that ends before its grammar has compiled leaves
    nothing behind once the compilation ends."""
    import threading
    from multiprocessing import Pipe

    from liteinfer.structured_output.worker import GrammarWorker

    engine = tiny_llm.engine
    info = tokenizer_info(engine.tokenizer, engine.model_config.vocab_size,
                          engine.core.eos_token_ids)
    conn, _ = Pipe()
    bitmask = torch.zeros(2, 8, dtype=torch.int32)
    grammar_worker = GrammarWorker(conn, info.serialize_json(), bitmask, fill_threads=1,
                                   compile_threads=1, spin=False)
    release = threading.Event()
    grammar_worker.executor.submit(release.wait)  # the compilation waits behind this
    grammar_worker._compile(0, StructuredOutputsParams(regex="a+"))
    grammar_worker._add("gone", 0)
    grammar_worker._add("kept", 0)
    grammar_worker._finish(["gone"])
    release.set()
    grammar_worker.grammars[0].result(timeout=60)
    assert grammar_worker._finished_compiles() == [(0, None)]
    assert set(grammar_worker.matchers) == {"kept"}


@pytest.mark.parametrize("spin", [False, True])
def test_a_dead_grammar_process_fails_only_the_constrained_requests(tiny_llama_dir, monkeypatch,
                                                                    spin):
    """The grammar process killed mid-run: the constrained requests finish with an error that
    says so, the others run to their full length with the tokens they get alone, later
    constrained requests fail at once and unconstrained ones still run. With `spin`, both ends
    spin on the pipe (as on machines with CPUs to spare), and the core's spin ends when the
    grammar process does."""
    import liteinfer.structured_output.manager as manager_module
    from fixtures import build_llm

    monkeypatch.setattr(manager_module, "cpus_to_spin", lambda spinners: spin)
    llm = build_llm(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=256)
    engine = llm.engine
    prompts = ["The quick brown fox", "Hello world! How are", "Once upon a time there"]
    free = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, free, use_tqdm=False)]
    held = SamplingParams(temperature=0.0, max_tokens=30,
                          structured_outputs=StructuredOutputsParams(regex=r"[a-z]{60}"))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"free{i}", prompt, free)
        engine.add_request(f"held{i}", prompt, held)
    done, tokens = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids  # all so far
            if out.finished:
                done[out.request_id] = out
        if len(tokens.get("held0", [])) == 5:  # the grammars run: stop their process
            process = engine.core.structured_output._process.result().proc
            process.kill()
            process.join()
    for i in range(3):
        assert (done[f"free{i}"].outputs[0].finish_reason, tokens[f"free{i}"]) == (
            "length", alone[i])
        assert done[f"held{i}"].outputs[0].finish_reason == "error"
        assert "grammar process exited" in done[f"held{i}"].error
    later = llm.generate(prompts[:2], [held, free], use_tqdm=False)
    assert later[0].outputs[0].finish_reason == "error"
    assert "grammar process exited" in later[0].error
    assert later[1].outputs[0].token_ids == alone[1]


@pytest.mark.parametrize("constraint, message", [
    ({"regex": "a(b"}, "invalid regex for structured outputs: Regex parsing error"),
    ({"json": '{"type": '}, "invalid JSON schema for structured outputs"),
    ({"json": {"type": "objectx"}}, 'Unsupported type "objectx"'),
    ({"grammar": 'root ::= "a" |'}, "invalid grammar for structured outputs: EBNF parser"),
])
def test_invalid_constraints_are_value_errors(tiny_llm, constraint, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny_llm.generate(["Hi"], SamplingParams(
            structured_outputs=StructuredOutputsParams(**constraint)), use_tqdm=False)


@pytest.mark.parametrize("fields", [{}, {"regex": "a", "choice": ["b"]}, {"choice": []},
                                    {"choice": ["a", 1]}, {"json": 3}])
def test_params_take_exactly_one_valid_constraint(fields):
    with pytest.raises(ValueError, match="structured outputs"):
        StructuredOutputsParams(**fields)


@pytest.mark.gpu
def test_constrained_generation_on_cuda(tiny_llama_dir):
    """The bitmask copied from shared, CUDA-registered memory and applied by xgrammar's
    Triton kernel (in place when every row is greedy), with overlap scheduling, CUDA graphs and
    the next decode step's inputs sent before the constrained step is sampled: outputs
    validate, every token is one the grammar allows, unconstrained rows beside them keep their
    tokens."""
    from fixtures import build_llm

    llm = build_llm(str(tiny_llama_dir), dtype="float32", device="cuda", max_model_len=256)
    prompts = ["The quick brown fox", "Hello world! How are", "Once upon a time there"]
    free = SamplingParams(temperature=0.0, max_tokens=24)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, free, use_tqdm=False)]
    constraint = StructuredOutputsParams(json=Order.model_json_schema(),
                                         disable_any_whitespace=True)
    for temperature in (0.0, 1.0):
        held = SamplingParams(temperature=temperature, seed=7, max_tokens=150,
                              structured_outputs=constraint)
        mixed = llm.generate(prompts + prompts, [free] * 3 + [held] * 3, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
        for o in mixed[3:]:
            Order.model_validate_json(o.outputs[0].text)
            assert replay(llm, constraint, o.outputs[0].token_ids).is_terminated()


def test_params_cross_the_engine_core_boundary():
    """The constraint travels inside SamplingParams in msgspec-encoded engine-core requests."""
    import msgspec

    from liteinfer.engine.messages import EngineCoreRequest

    for constraint in (StructuredOutputsParams(json=Order.model_json_schema()),
                       StructuredOutputsParams(choice=["a", "b"], disable_any_whitespace=True),
                       StructuredOutputsParams(json_object=True)):
        request = EngineCoreRequest("r", [1, 2], SamplingParams(structured_outputs=constraint),
                                    0.0)
        decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest)
        assert decoded.sampling_params.structured_outputs == constraint
        assert decoded.sampling_params.structured_outputs.key == constraint.key
