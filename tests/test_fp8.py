"""FP8 on the CPU path: e4m3 linear layers (quantized at load, or from compressed-tensors
checkpoints) and the e4m3 KV cache, against the model-dtype engine and independent references.

Accuracy rule for quantized runs (`assert_agree`): greedy tokens equal the reference's at every
step whose reference top-2 logprob margin exceeds MARGIN (a divergence is allowed only at a
closer call, and ends the comparison of that sequence, whose contexts then differ), and at every
step compared the logprobs of the reference's top-5 tokens within LOGPROB_TOL of the reference's.
"""
from __future__ import annotations

import pytest
import torch

from fixtures import build_llm
from liteinfer import SamplingParams
from reference import random_prompts

# Bounds for the tiny random model (TINY_LLAMA), whose logits are O(0.1) with top-2 margins
# often under 0.01: e4m3 rounds each weight and activation by up to 2^-4 of itself, which over
# its 64-128-wide dot products moved logprobs by at most 0.018 (measured over these prompts). A
# margin above twice the logprob bound cannot flip.
LOGPROB_TOL = 0.03
MARGIN = 2 * LOGPROB_TOL
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)


def assert_agree(reference, outputs, margin: float = MARGIN,
                 logprob_tol: float = LOGPROB_TOL) -> None:
    compared = total = 0
    for ref, out in zip(reference, outputs, strict=True):
        ref, out = ref.outputs[0], out.outputs[0]
        total += len(ref.token_ids)
        for step, (want, got) in enumerate(zip(ref.token_ids, out.token_ids, strict=True)):
            top = sorted(ref.logprobs[step].items(), key=lambda kv: -kv[1])[:5]
            common = [(t, lp) for t, lp in top if t in out.logprobs[step]]
            assert common and common[0][0] == top[0][0], "the reference's top token is missing"
            worst = max(abs(out.logprobs[step][t] - lp) for t, lp in common)
            assert worst <= logprob_tol, f"step {step}: logprob off by {worst:.3g}"
            compared += 1
            if got != want:
                gap = top[0][1] - top[1][1]
                assert gap <= margin, f"step {step}: {got} != {want} with margin {gap:.3g}"
                break
    assert compared >= total // 2, f"only {compared} of {total} steps compared"


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, 300, 3, 40, seed=7)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, prompts):
    llm = build_llm(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=256)
    return llm.generate(prompts, GREEDY, use_tqdm=False)


@pytest.mark.parametrize("kwargs", [{"quantization": "fp8"}, {"kv_cache_dtype": "fp8"},
                                    {"quantization": "fp8", "kv_cache_dtype": "fp8"}],
                         ids=["fp8-linear", "fp8-kv", "fp8-both"])
def test_fp8_agrees_with_fp32(tiny_llama_dir, prompts, reference, kwargs):
    llm = build_llm(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=256,
                    **kwargs)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_agree(reference, outputs)
