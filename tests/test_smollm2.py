"""The real SmolLM2-135M-Instruct (GGUF) against transformers' own GGUF loading."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from liteinfer import SamplingParams
from reference import hf_greedy

QUESTIONS = [
    "What is the capital of France?",
    "Hi",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "What is twelve times twelve, and how do you know?",
    "Translate 'good morning' into Spanish and say which language it is.",
    "List the planets of the solar system in order from the sun, separated by commas.",
]


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path):
    return AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def chat_prompts(smollm2_llm):
    return [smollm2_llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


def test_greedy_batch_matches_transformers(smollm2_llm, hf_smollm2, chat_prompts):
    eos = smollm2_llm.engine.core.eos_token_ids
    reference = hf_greedy(hf_smollm2, chat_prompts, 32, stop_at_eos=True, eos_token_id=eos)
    params = SamplingParams(temperature=0.0, max_tokens=32)
    outputs = smollm2_llm.generate(chat_prompts, params, use_tqdm=False)
    assert len({len(p) for p in chat_prompts}) == len(chat_prompts)
    assert [o.outputs[0].token_ids for o in outputs] == reference


def test_answers_the_capital_of_france(smollm2_llm):
    out = smollm2_llm.chat([{"role": "user", "content": QUESTIONS[0]}],
                           SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"


def test_stop_string_cuts_the_text(smollm2_llm):
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    full = smollm2_llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=32),
                            use_tqdm=False)[0].outputs[0].text
    out = smollm2_llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=32, stop=["Paris"]),
                           use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", "Paris")
    assert out.text == full[:full.index("Paris")]


def test_streamed_text_adds_up(smollm2_llm, chat_prompts):
    params = SamplingParams(temperature=0.0, max_tokens=24)
    pieces = [o.new_text for o in smollm2_llm.stream(chat_prompts[3], params)]
    final = smollm2_llm.generate([chat_prompts[3]], params, use_tqdm=False)[0].outputs[0].text
    assert len(pieces) > 1 and "".join(pieces) == final
