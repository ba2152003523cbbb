"""The real SmolLM2-135M on the CPU: how far `quantization="fp8"` moves the fp32 model's top-5
logprobs along the fp32 model's own greedy answers, with the LM head in the model dtype and in
e4m3 (the default). Where the fp8 model's token differs, it resumes from the fp32 tokens up to
there (as tests/test_fp8.py's rule does), so every step is compared in the reference's context.
Prints, per head, the steps compared, the divergences and the max / median / mean / p90 of each
step's largest top-5 logprob change. About 10 minutes on 2 cores.

    python scripts/fp8_lm_head_accuracy.py
"""
import json

import torch

from liteinfer import LLM, SamplingParams
from liteinfer.layers.quantization import fp8 as fp8mod
from liteinfer.loader import smollm2_gguf_path

QUESTIONS = ["What is the capital of France?", "Name three primary colors.",
             "List the planets of the solar system in order from the sun, separated by commas.",
             "Write a haiku about the sea.", "Explain what a CPU does in two sentences."]
TOKENS = 48


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, logprobs=5, ignore_eos=True)


def deviations(llm: LLM, prompts: list[list[int]], refs: list) -> dict[str, float]:
    devs, flips = [], 0
    for prompt, ref in zip(prompts, refs, strict=True):
        ids, done = list(ref.token_ids), 0
        while done < len(ids):
            out = llm.generate([prompt + ids[:done]], greedy(len(ids) - done),
                               use_tqdm=False)[0].outputs[0]
            resume = len(ids)
            for k, token in enumerate(out.token_ids):
                step = done + k
                top = sorted(ref.logprobs[step].items(), key=lambda kv: -kv[1].logprob)[:5]
                devs.append(max(abs(out.logprobs[k][t].logprob - e.logprob)
                                for t, e in top if t in out.logprobs[k]))
                if token != ids[step]:
                    flips, resume = flips + 1, step + 1
                    break
            done = resume
    d = torch.tensor(devs)
    return {"steps": len(devs), "divergences": flips, "max": d.max().item(),
            "p50": d.median().item(), "mean": d.mean().item(), "p90": d.quantile(0.9).item()}


def main() -> None:
    path = str(smollm2_gguf_path())
    reference = LLM(path, dtype="float32", device="cpu", max_model_len=512)
    prompts = [reference.apply_chat_template([{"role": "user", "content": q}])
               for q in QUESTIONS]
    refs = [o.outputs[0] for o in reference.generate(prompts, greedy(TOKENS), use_tqdm=False)]
    results = {}
    default_head = fp8mod.Fp8Config.lm_head_method
    for head in ("model-dtype", "e4m3"):
        if head == "model-dtype":
            fp8mod.Fp8Config.lm_head_method = lambda self, use_triton: None
        llm = LLM(path, dtype="float32", device="cpu", max_model_len=512, quantization="fp8")
        fp8mod.Fp8Config.lm_head_method = default_head
        results[head] = deviations(llm, prompts, refs)
        print(head, results[head], flush=True)
        del llm
    print(json.dumps(results))


if __name__ == "__main__":
    main()
