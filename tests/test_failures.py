"""One request never hurts another, offline: requests that cannot run are refused before they
are admitted; a step that still fails finishes only its own requests, returns their blocks and
leaves the engine usable, with outputs equal to a fresh engine's. A request the core loses ends
with an error, offline and in the core process's loop, instead of being waited for."""
from __future__ import annotations

import pytest

from fixtures import build_llm
from liteinfer import SamplingParams
from liteinfer.engine.sampler import Sampler
from reference import random_prompts


def greedy(n: int = 12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def prompts(tiny_llm):
    return random_prompts(8, tiny_llm.engine.model_config.vocab_size, 3, 30, seed=11)


@pytest.fixture(scope="module")
def alone(tiny_llm, prompts):
    return [tokens(tiny_llm.generate([p], greedy(), use_tqdm=False))[0] for p in prompts]


@pytest.mark.parametrize("params, message", [
    (dict(temperature=0.8, seed=2**64), "seed"),            # past torch's 64-bit seeds
    (dict(temperature=0.8, seed=-(2**63) - 1), "seed"),
    (dict(temperature=0.8, top_k=10**12), "top_k"),          # past the vocabulary
    (dict(n=0), "n must be"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
])
def test_parameters_that_cannot_run_are_refused_before_admission(tiny_llm, prompts, alone,
                                                                 params, message):
    """These used to pass validation and fail the sampler inside a step shared with others."""
    with pytest.raises(ValueError, match=message):
        tiny_llm.generate([prompts[0], prompts[1]], [greedy(), SamplingParams(**params)],
                          use_tqdm=False)
    assert not tiny_llm.engine.has_unfinished_requests()
    assert tokens(tiny_llm.generate(prompts, greedy(), use_tqdm=False)) == alone


def test_extreme_valid_seeds_sample(tiny_llm, prompts):
    for seed in (2**64 - 1, -(2**63), 0):
        out = tiny_llm.generate([prompts[0]], SamplingParams(temperature=1.0, seed=seed,
                                                             max_tokens=4), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4


def test_caller_params_are_not_changed(tiny_llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=None)
    tiny_llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=3),
                      use_tqdm=False)
    tiny_llm.engine.add_request("keep", prompts[0], params)
    tiny_llm.engine.abort("keep")
    assert params.max_tokens is None


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(tiny_llama_dir, prompts,
                                                                  alone, monkeypatch):
    """A sampler that raises whenever one poisoned request is in the batch: the requests of
    that step fail with finish reason "error", the others (admitted later) finish with the
    output they have alone, every block comes back, and the next generate() equals a fresh
    engine's. Before, the good outputs were lost, 6 of 8 blocks leaked, sequences stayed
    RUNNING and a later generate() could spin forever."""
    llm = build_llm(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=256,
                    max_num_seqs=2)
    sample = Sampler.sample

    def poisoned(self, logits, seqs, *rest):
        if any(s.sampling_params.max_tokens == 7 for s in seqs):
            raise RuntimeError("sampler exploded")
        return sample(self, logits, seqs, *rest)

    monkeypatch.setattr(Sampler, "sample", poisoned)
    params = [greedy(7)] + [greedy()] * (len(prompts) - 1)
    outs = llm.generate(prompts, params, use_tqdm=False)  # returns: nothing raised
    failed = [i for i, o in enumerate(outs) if o.outputs[0].finish_reason == "error"]
    # The poisoned request and the one sharing its step (max_num_seqs=2) failed, at once.
    assert failed == [0, 1] and all("sampler exploded" in outs[i].error for i in failed)
    assert tokens(outs)[2:] == alone[2:]
    core = llm.engine.core
    assert not core.has_unfinished_requests()
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    monkeypatch.setattr(Sampler, "sample", sample)
    assert tokens(llm.generate(prompts, greedy(), use_tqdm=False)) == alone


def test_a_request_the_core_lost_fails_instead_of_hanging(tiny_llm, prompts, alone):
    """A request the front end awaits but the core no longer holds (here aborted in the core
    alone) ends with finish reason "error" at the next step, and generate() returns, with the
    other requests' outputs whole."""
    engine = tiny_llm.engine
    engine.add_request("lost", prompts[0], greedy())
    engine.core.abort_requests(["lost"])
    outs = tiny_llm.generate(prompts[1:3], greedy(), use_tqdm=False)
    assert tokens(outs) == alone[1:3]
    assert not engine.has_unfinished_requests()
    (buffered,) = tiny_llm._buffered.pop("lost")  # kept for a stream() that never came
    assert buffered.outputs[0].finish_reason == "error"
    engine.add_request("lost", prompts[0], greedy())
    engine.core.abort_requests(["lost"])
    (out,) = engine.step()
    assert out.request_id == "lost" and out.outputs[0].finish_reason == "error"
    assert "lost" in out.error
    assert not engine.has_unfinished_requests()


def test_an_interrupted_generate_leaves_nothing_behind(tiny_llm, prompts, alone, monkeypatch):
    engine = tiny_llm.engine
    step = engine.step
    calls = []

    def interrupted():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tiny_llm.generate(prompts, greedy(), use_tqdm=False)
    monkeypatch.setattr(engine, "step", step)
    assert not engine.has_unfinished_requests()
    assert tokens(tiny_llm.generate(prompts, greedy(), use_tqdm=False)) == alone


def test_the_core_process_fails_a_request_its_core_lost(tiny_llama_dir, prompts, alone):
    """The core process's loop (in this process, on its own sockets): a request its core no
    longer holds gets an error output once the core has nothing left, so the front end's
    stream ends; the other request's tokens are whole."""
    import time

    import msgspec
    import zmq

    from liteinfer.engine.core_process import ADD, CoreAddresses, EngineCoreProc
    from liteinfer.engine.messages import EngineCoreOutputs, EngineCoreRequest

    llm = build_llm(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=256)
    ctx = zmq.Context()
    addresses = CoreAddresses.in_new_dir(1)
    proc = EngineCoreProc(llm.engine.core, ctx, addresses)
    front = ctx.socket(zmq.PUSH)
    front.connect(addresses.input)
    back = ctx.socket(zmq.PULL)
    back.connect(addresses.outputs[0])
    try:
        requests = [EngineCoreRequest(rid, prompts[i], greedy(), time.time())
                    for i, rid in enumerate(("kept", "lost"))]
        front.send_multipart([ADD, msgspec.msgpack.encode(requests)])
        while not proc.core.has_unfinished_requests():
            proc._take_inputs()
        proc._step()
        proc.core.abort_requests(["lost"])  # behind the process's back
        while proc.core.has_unfinished_requests():
            proc._step()
        decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        got: dict[str, list] = {}
        while back.poll(1000):
            for out in decoder.decode(back.recv()).outputs:
                got.setdefault(out.request_id, []).append(out)
        assert [t for out in got["kept"] for t in out.new_token_ids] == alone[0]
        assert got["lost"][-1].finish_reason == "error" and "lost" in got["lost"][-1].error
        assert not proc.owner
    finally:
        for sock in (front, back, proc.input, *proc.outputs):
            sock.close(linger=0)
        ctx.term()
        llm.shutdown()
