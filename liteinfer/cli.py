"""`liteinfer generate | chat | serve | bench` (`liteinfer bench ...` is `liteinfer-bench ...`)."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from liteinfer.config import EngineConfig, parse_overrides
from liteinfer.entrypoints.arg_utils import add_dataclass_args, dataclass_kwargs
from liteinfer.loader.overrides import (
    GENERATION_CONFIG_CHOICES,
    ModelOverrides,
    load_chat_template,
    load_generation_config,
)
from liteinfer.logger import LEVELS, LOGGERS, configure_logging

DEFAULT_MODEL = "smollm2-135m-instruct"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The model, --log-level and every EngineConfig field as a flag (`max_num_seqs` as
    --max-num-seqs, booleans as --x / --no-x), `--set KEY=VALUE`, and the model-file overrides.
    `engine_kwargs` and `model_overrides` read them back."""
    parser.add_argument("model_tag", nargs="?", metavar="MODEL",
                        help=f"HF model directory or id (org/name, from the local Hugging Face "
                             f"cache), .gguf file or a known name (default: {DEFAULT_MODEL})")
    parser.add_argument("--model", help="the same as MODEL")
    parser.add_argument("--log-level", default="info", choices=LEVELS,
                        help="of every process's log lines (default: %(default)s)")
    parser.add_argument("--load-format", default="auto",
                        choices=["auto", "safetensors", "gguf", "dummy"])
    engine = parser.add_argument_group("engine arguments (EngineConfig, liteinfer/config.py)")
    add_dataclass_args(engine, EngineConfig)
    engine.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="an engine argument by its field name, e.g. "
                                                  "max_num_seqs=64 (a flag of it wins)")
    engine.add_argument("--chat-template", metavar="FILE|TEMPLATE",
                        help="a Jinja chat template (a file or the template itself) used in "
                             "place of the tokenizer's")
    engine.add_argument("--generation-config", default="auto", metavar=GENERATION_CONFIG_CHOICES,
                        help="default sampling settings: auto = the model's "
                             "generation_config.json, vllm = none, DIR = that directory's "
                             "(default: %(default)s)")


def model_name(args: argparse.Namespace) -> str:
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    return args.model_tag or args.model or DEFAULT_MODEL


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments: `--set` pairs, then the flags given."""
    return {**parse_overrides(args.overrides), **dataclass_kwargs(args, EngineConfig)}


def model_overrides(args: argparse.Namespace) -> ModelOverrides:
    """--chat-template and --generation-config read (None: the model's own)."""
    template = None if args.chat_template is None else load_chat_template(args.chat_template)
    return ModelOverrides(template, load_generation_config(args.generation_config))


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    """Sampling arguments of the offline commands; unset ones take the generation config's
    values, and greedy decoding when it states no temperature. --seed seeds sampling too."""
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)


def _llm(args: argparse.Namespace):
    from liteinfer import LLM

    overrides = model_overrides(args)
    llm = LLM(model_name(args), load_format=args.load_format, **engine_kwargs(args))
    overrides.apply(llm.engine)
    return llm


def _params(args: argparse.Namespace, llm: Any):
    from liteinfer import SamplingParams
    from liteinfer.llm import generation_defaults

    given = {k: getattr(args, k) for k in ("temperature", "top_p", "top_k")
             if getattr(args, k) is not None}
    defaults = {"temperature": 0.0, **generation_defaults(llm.engine.generation_config)}
    return SamplingParams(**{**defaults, **given}, seed=getattr(args, "seed", None),
                          max_tokens=args.max_tokens)


def cmd_generate(args: argparse.Namespace) -> None:
    llm = _llm(args)
    params = _params(args, llm)
    prompts = args.prompt or ["What is the capital of France?"]
    if args.use_chat_template:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                           use_tqdm=False)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        print(f"> {prompt}\n{out.outputs[0].text.strip()}\n")


def cmd_chat(args: argparse.Namespace) -> None:
    llm = _llm(args)
    params = _params(args, llm)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("liteinfer chat: empty line or Ctrl-D to quit")
    while True:
        try:
            user = input("you> ").strip()
        except EOFError:
            break
        if not user:
            break
        history.append({"role": "user", "content": user})
        print("model> ", end="", flush=True)
        reply = ""
        for out in llm.stream(llm.apply_chat_template(history), params):
            print(out.new_text, end="", flush=True)
            reply = out.outputs[0].text
        print()
        history.append({"role": "assistant", "content": reply})


def cmd_serve(args: argparse.Namespace) -> None:
    from liteinfer.entrypoints.openai.api_server import run_server
    from liteinfer.entrypoints.openai.cli_args import server_args

    run_server(model_name(args), args.host, args.port, args.served_model_name, args.load_format,
               server_args(args), model_overrides(args), **engine_kwargs(args))


def build_parser() -> argparse.ArgumentParser:
    from liteinfer.entrypoints.openai.cli_args import add_server_args

    parser = argparse.ArgumentParser(prog="liteinfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for prompts")
    add_engine_args(gen)
    _add_sampling_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--no-chat-template", dest="use_chat_template", action="store_false",
                     help="send prompts as raw text instead of as chat messages")
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive, streaming chat")
    add_engine_args(chat)
    _add_sampling_args(chat)
    chat.add_argument("--system", default=None, help="a system message")
    chat.set_defaults(func=cmd_chat)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, "
                                         "/v1/chat/completions, /v1/models)")
    add_engine_args(serve)
    add_server_args(serve)
    serve.set_defaults(func=cmd_serve)
    # Listed for --help; main() hands `bench ...` to the harness, which parses its own arguments
    # and is imported only then.
    sub.add_parser("bench", add_help=False, help="benchmarks: run, serve, report, timeline, "
                                                 "quality (the same as liteinfer-bench)")
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from liteinfer.bench.cli import main as bench_main

        bench_main(argv[1:])
        return
    args = build_parser().parse_args(argv)
    # The engine's notes (e.g. max_model_len fitted to the KV pool) are part of the output.
    handler = configure_logging(args.log_level)
    try:
        args.func(args)
    except ValueError as e:
        sys.exit(f"error: {e}")
    finally:
        for name in LOGGERS:
            logging.getLogger(name).removeHandler(handler)


if __name__ == "__main__":
    main()
