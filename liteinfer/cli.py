"""`liteinfer generate | chat | serve` (benchmarks: `liteinfer-bench`)."""
from __future__ import annotations

import argparse
import sys

DEFAULT_MODEL = "smollm2-135m-instruct"


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="HF model directory, .gguf file or a known name (default: %(default)s)")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """Engine and sampling arguments of the offline commands."""
    _add_engine_args(p)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def _llm(args: argparse.Namespace):
    from liteinfer import LLM
    return LLM(args.model, load_format=args.load_format, device=args.device, dtype=args.dtype,
               max_model_len=args.max_model_len)


def _params(args: argparse.Namespace):
    from liteinfer import SamplingParams
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          seed=args.seed, max_tokens=args.max_tokens)


def cmd_generate(args: argparse.Namespace) -> None:
    llm = _llm(args)
    params = _params(args)
    prompts = args.prompt or ["What is the capital of France?"]
    if args.chat_template:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                           use_tqdm=False)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        print(f"> {prompt}\n{out.outputs[0].text.strip()}\n")


def cmd_chat(args: argparse.Namespace) -> None:
    llm = _llm(args)
    params = _params(args)
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
    from liteinfer.bench.cli import parse_overrides
    from liteinfer.entrypoints.openai.api_server import run_server
    from liteinfer.entrypoints.openai.cli_args import server_args

    run_server(args.model, args.host, args.port, args.served_model_name, args.load_format,
               server_args(args), device=args.device, dtype=args.dtype,
               max_model_len=args.max_model_len, **parse_overrides(args.overrides))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="liteinfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for prompts")
    _add_model_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--no-chat-template", dest="chat_template", action="store_false",
                     help="send prompts as raw text instead of as chat messages")
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive, streaming chat")
    _add_model_args(chat)
    chat.add_argument("--system", default=None, help="a system message")
    chat.set_defaults(func=cmd_chat)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, "
                                         "/v1/chat/completions, /v1/models)")
    _add_engine_args(serve)
    from liteinfer.entrypoints.openai.cli_args import add_server_args
    add_server_args(serve)
    serve.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="KEY=VALUE", help="any engine argument, e.g. max_num_seqs=64")
    serve.set_defaults(func=cmd_serve)
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except ValueError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
