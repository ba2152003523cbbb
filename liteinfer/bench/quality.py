"""`liteinfer bench quality`: what a quantization costs, measured as llama.cpp's
`perplexity --kl-divergence` measures it.

The text is an English one that ships with every Debian-based machine (base-files' GPL-3,
copied to benchmarks/text/ so that CI has it). It is cut into windows of `window` tokens, each
run as one prompt; as in llama.cpp, the first half of a window is context only and each position
of the second half is scored. Per quantization, against the same model unquantized (fp32 on
the CPU, the model dtype elsewhere), position by position:

- perplexity: exp of the mean negative log-likelihood of the text's next token;
- KL divergence of the quantized next-token distribution from the reference's, its mean and
  99th percentile over the positions;
- top-1 agreement: the share of positions whose most likely token is the reference's.

The quantizations: FP8 weights and activations, an FP8 KV cache, int4 at load (round to
nearest, groups of 128), and GGUF block types, written here from the reference's weights with
the `gguf` library's quantizer (the types it can write: Q8_0, Q4_0 and Q4_1; the K-quants it
can only read) and loaded kept in their blocks. For SmolLM2, whose only weights are a Q4_1 GGUF,
the reference is that file dequantized: each quantization is a second rounding of those
weights, so its numbers are an upper bound on what the quantization costs a full-precision
model, not llama.cpp's figures for it.
"""
from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from liteinfer.bench.store import append_row, environment, now_iso

TEXT = Path("benchmarks/text/GPL-3")
QUALITY_DIR = Path("benchmarks/quality")
DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class Quantization:
    """An engine setting, or (gguf_type) the model rewritten as that GGUF type."""

    name: str
    engine_args: dict[str, Any] = field(default_factory=dict)
    gguf_type: str | None = None


QUANTIZATIONS = (
    Quantization("fp8", {"quantization": "fp8"}),
    Quantization("fp8 KV", {"kv_cache_dtype": "fp8"}),
    Quantization("int4 RTN", {"quantization": "int4"}),
    Quantization("GGUF Q8_0", gguf_type="Q8_0"),
    Quantization("GGUF Q4_1", gguf_type="Q4_1"),
    Quantization("GGUF Q4_0", gguf_type="Q4_0"),
)


def write_gguf(src: Path, dst: Path, gguf_type: str) -> Path:
    """src (a llama GGUF) with every decoder projection re-quantized to gguf_type from its
    dequantized weights; the other tensors and the model's metadata (not its tokenizer: the
    harness feeds token ids) as they are."""
    import gguf

    from liteinfer.loader.gguf_file import open_reader

    reader = open_reader(src)
    qtype = gguf.GGMLQuantizationType[gguf_type]
    writer = gguf.GGUFWriter(str(dst), "llama")
    for key, f in reader.fields.items():
        if key.startswith("llama.") and f.types[0] != gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, f.contents(), f.types[0])
    for t in reader.tensors:
        if t.name.startswith("blk.") and t.name.split(".")[2] in (
                "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            w = gguf.quants.dequantize(t.data, t.tensor_type)
            writer.add_tensor(t.name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def text_windows(tokenizer: Any, window: int, tokens: int) -> list[list[int]]:
    ids = tokenizer(TEXT.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    n = min(tokens, len(ids)) // window
    if n == 0:
        raise ValueError(f"{TEXT} has {len(ids)} tokens, fewer than one window of {window}")
    return [ids[i * window:(i + 1) * window] for i in range(n)]


def engine_core(model: str, window: int, **engine_args: Any) -> Any:
    """The model's engine core (no front end, so no tokenizer built), its KV pool one window."""
    from liteinfer.config import EngineConfig
    from liteinfer.engine.core import EngineCore

    config = EngineConfig(max_model_len=window, max_num_seqs=1, max_num_batched_tokens=window,
                          num_kv_blocks=-(-window // EngineConfig.block_size) + 1, **engine_args)
    return EngineCore(model, config)


@torch.inference_mode()
def window_logprobs(core: Any, ids: list[int]) -> torch.Tensor:
    """fp32 log-probabilities of the next token at every position of ids [T, vocab]: one
    prefill of the whole window through the core's model, its K/V in the (idle) pool."""
    from liteinfer.attention import AttentionMetadata

    runner = core.runner
    device, n = runner.device, len(ids)
    blocks = -(-n // runner.block_size)
    meta = AttentionMetadata(
        is_prefill=True, slot_mapping=torch.arange(n, device=device),
        context_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None],
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=device),
        query_lens_host=[n], context_lens_host=[n])
    tokens = torch.tensor(ids, dtype=torch.int32, device=device)
    hidden = runner.model(tokens, torch.arange(n, device=device), meta)
    return runner.model.compute_logits(hidden).float().log_softmax(-1)


@dataclass
class Scores:
    """Per-position sums over the scored halves of the windows."""

    nll: list[torch.Tensor] = field(default_factory=list)
    kl: list[torch.Tensor] = field(default_factory=list)
    same_top: list[torch.Tensor] = field(default_factory=list)

    def add(self, logprobs: torch.Tensor, targets: torch.Tensor,
            reference: torch.Tensor | None) -> None:
        self.nll.append(-logprobs.gather(1, targets[:, None])[:, 0].double())
        if reference is not None:
            kl = (reference.exp() * (reference - logprobs)).sum(-1)
            self.kl.append(kl.double())
            self.same_top.append(logprobs.argmax(-1) == reference.argmax(-1))

    def row(self) -> dict[str, float]:
        out = {"perplexity": torch.cat(self.nll).mean().exp().item(),
               "positions": sum(len(x) for x in self.nll)}
        if self.kl:
            kl = torch.cat(self.kl)
            out.update(kl_mean=kl.mean().item(), kl_p99=kl.quantile(0.99).item(),
                       top1_agreement=torch.cat(self.same_top).double().mean().item())
        return out


def measure(model: str = DEFAULT_MODEL, quantizations: tuple[Quantization, ...] = QUANTIZATIONS,
            window: int = 512, tokens: int = 2048, **engine_args: Any) -> list[dict[str, Any]]:
    """One row per quantization (and the reference's, first): its perplexity and, against the
    reference, KL divergence and top-1 agreement. `engine_args` go to every engine (device,
    dtype)."""
    from liteinfer.loader import load_model_source

    source = load_model_source(model)
    if source.tokenizer is None:
        raise ValueError(f"{model} has no tokenizer to read {TEXT} with")
    windows = text_windows(source.tokenizer, window, tokens)
    half = window // 2
    targets = [torch.tensor(w[half + 1:]) for w in windows]  # the next token of each position
    reference, ref_scores = [], Scores()
    core = engine_core(model, window, **engine_args)
    for ids, target in zip(windows, targets, strict=True):
        lp = window_logprobs(core, ids)[half:-1]
        reference.append(lp)
        ref_scores.add(lp, target, None)
    core.shutdown()
    rows = [{"quantization": "none", **ref_scores.row()}]
    with tempfile.TemporaryDirectory() as tmp:
        for q in quantizations:
            path = model
            if q.gguf_type is not None:
                if source.load_format != "gguf":
                    raise ValueError(f"{q.name}: {model} is not a GGUF file to rewrite")
                path = str(write_gguf(source.path, Path(tmp) / f"{q.gguf_type}.gguf",
                                      q.gguf_type))
            core = engine_core(path, window, **engine_args, **q.engine_args)
            scores = Scores()
            for ids, target, ref in zip(windows, targets, reference, strict=True):
                scores.add(window_logprobs(core, ids)[half:-1], target, ref)
            core.shutdown()
            rows.append({"quantization": q.name, **scores.row()})
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    lines = ["| quantization | perplexity | mean KL | KL p99 | top-1 agreement |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        if "kl_mean" in r:
            stats = f"{r['kl_mean']:.5f} | {r['kl_p99']:.4f} | {r['top1_agreement']:.2%}"
        else:
            stats = "(reference) | | "
        lines.append(f"| {r['quantization']} | {r['perplexity']:.3f} | {stats} |")
    return "\n".join(lines)


def add_quality_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "quality", help="perplexity, KL divergence and top-1 agreement per quantization",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--quantization", nargs="+", metavar="NAME",
                   help=f"default: all of {[q.name for q in QUANTIZATIONS]}")
    p.add_argument("--window", type=int, default=512, help="tokens a window (default 512)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of the text read "
                                                            "(default 2048)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", help="the model dtype (default float32)")
    p.add_argument("--out", type=Path, default=QUALITY_DIR,
                   help=f"directory for the rows (default {QUALITY_DIR}); 'none': no rows")
    p.set_defaults(func=cmd_quality)


def cmd_quality(args: argparse.Namespace) -> None:
    chosen = QUANTIZATIONS
    if args.quantization:
        known = {q.name: q for q in QUANTIZATIONS}
        unknown = [n for n in args.quantization if n not in known]
        if unknown:
            raise ValueError(f"unknown quantization(s) {unknown}; choose from {list(known)}")
        chosen = tuple(known[n] for n in args.quantization)
    rows = measure(args.model, chosen, args.window, args.tokens, device=args.device,
                   dtype=args.dtype)
    print(render(rows))
    if str(args.out) == "none":
        return
    when, env = now_iso(), environment()
    path = args.out / f"{when[:10]}-{args.device}.jsonl"
    for row in rows:
        append_row({**row, **env, "time": when, "model": args.model, "window": args.window,
                    "dtype": args.dtype}, path)
    print(f"rows appended to {path}")
