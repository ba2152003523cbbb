"""Reference outputs from transformers, the implementation liteinfer is checked against."""
from __future__ import annotations

import torch
from transformers import GenerationConfig


@torch.no_grad()
def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int, stop_at_eos: bool = False,
              eos_token_id: int | list[int] | None = None) -> list[list[int]]:
    """transformers' generate, one prompt at a time (no padding), greedy."""
    device = next(model.parameters()).device
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                              eos_token_id=eos_token_id if stop_at_eos else None)
    outs = []
    # generate() falls back to the model's own generation config for unset fields, EOS included.
    saved, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        outs.append(gen[0, len(prompt):].tolist())
    model.generation_config.eos_token_id = saved
    return outs


def random_prompts(n: int, vocab: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for length in lengths]


def assert_same_greedy_outputs(outs, refs, tolerance: float) -> None:
    """Two engines' greedy RequestOutputs: the same tokens, and the same top logprobs within
    tolerance."""
    for out, ref in zip(outs, refs, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        for got, want in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs, strict=True):
            assert got.keys() == want.keys()
            assert all(abs(got[t].logprob - want[t].logprob) < tolerance for t in want)
