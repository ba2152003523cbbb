"""How often a prompt's greedy answer alone differs from its answer among the others (128
requests at once by default), in the default mode or with batch_invariant: the README's figures.
Dummy weights; prints one JSON line.

    python scripts/batch_invariance_mismatch.py --model llama-3.2-1b-instruct
    python scripts/batch_invariance_mismatch.py --model llama-3.1-8b-instruct --batch-invariant
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from liteinfer import LLM, SamplingParams


def random_prompts(n: int, vocab: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for length in lengths]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.2-1b-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=128, help="requests run at once")
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch-invariant", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    llm = LLM(args.model, load_format="dummy", dtype=args.dtype, max_num_seqs=args.prompts,
              max_model_len=args.max_len + args.max_tokens, batch_invariant=args.batch_invariant)
    prompts = random_prompts(args.prompts, llm.engine.model_config.vocab_size, args.min_len,
                             args.max_len, args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                            logprobs=0)

    def answer(out) -> tuple[list[int], list[float]]:
        c = out.outputs[0]
        return c.token_ids, [e[t].logprob for t, e in zip(c.token_ids, c.logprobs)]

    alone = [answer(llm.generate([q], params, use_tqdm=False)[0]) for q in prompts]
    together = [answer(o) for o in llm.generate(prompts, params, use_tqdm=False)]
    diverged = [next(i for i, (a, b) in enumerate(zip(x[0], y[0])) if a != b)
                for x, y in zip(alone, together) if x[0] != y[0]]
    print(json.dumps({
        "model": args.model, "dtype": args.dtype, "batch_invariant": args.batch_invariant,
        "prompts": args.prompts, "max_tokens": args.max_tokens,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "answers_differ": len(diverged),
        "logprobs_differ": sum(x != y for x, y in zip(alone, together)),
        "median_first_divergent_token": statistics.median(diverged) if diverged else None}))


if __name__ == "__main__":
    main()
