"""A GGUF file as a Hugging Face directory (safetensors, config, tokenizer), dequantized by
transformers' own GGUF reader: how the SmolLM2 file that liteinfer loads directly reaches
engines that take HF directories only (vLLM's speculative decoding benchmarks).

    python scripts/gguf_to_hf.py FILE.gguf OUT_DIR [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("gguf", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    kwargs = {"gguf_file": args.gguf.name}
    model = AutoModelForCausalLM.from_pretrained(args.gguf.parent, dtype=getattr(
        torch, args.dtype), **kwargs)
    # The weights are dequantized already; transformers still marks the model as GGUF-quantized
    # and refuses to save it.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(args.out)
    AutoTokenizer.from_pretrained(args.gguf.parent, **kwargs).save_pretrained(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
