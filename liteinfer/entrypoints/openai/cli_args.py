"""`liteinfer serve`'s flags: where to listen, the API key, and the server's limits (importable
without the ASGI stack, so that the CLI parses without it)."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from liteinfer.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from liteinfer.entrypoints.openai.tool_parsers import TOOL_PARSERS


@dataclass
class ServerArgs:
    """The server's limits and switches (each a `liteinfer serve` flag)."""

    api_key: str | None = None
    metrics_need_key: bool = False
    max_body_bytes: int = 8 * 2**20
    max_prompts_per_request: int = 256
    max_prompt_tokens_per_request: int = 2**20
    # Requests beyond a full batch that may wait for a slot; past them, a 503.
    max_waiting_requests: int = 1024
    shutdown_grace_s: float = 5.0
    # How tool calls are read from outputs under tool_choice "auto" (tool_parsers/).
    tool_call_parser: str = "llama3_json"
    # How a reasoning model's reasoning is split from its answer (reasoning_parsers/).
    reasoning_parser: str | None = None
    # API-server processes sharing one engine core (a process can stream only so many events).
    api_server_count: int = 1


def default_api_server_count() -> int:
    """One front-end process per four cores, up to four: enough to stream 128 requests at a
    step every couple of milliseconds (one event per request per step), leaving cores for the
    engine core and the clients."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


def add_server_args(p: argparse.ArgumentParser) -> None:
    defaults = ServerArgs()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the model's name in the API (default: the "
                                               "model's name or its directory's)")
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` on every route but "
                                     "/health (default: $LITEINFER_API_KEY, if set)")
    p.add_argument("--metrics-need-key", action="store_true",
                   help="with --api-key, /metrics needs the key too (default: open)")
    p.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes,
                   help="larger request bodies get a 413 (default: %(default)s)")
    p.add_argument("--max-prompts-per-request", type=int,
                   default=defaults.max_prompts_per_request, help="default: %(default)s")
    p.add_argument("--max-prompt-tokens-per-request", type=int,
                   default=defaults.max_prompt_tokens_per_request,
                   help="prompt tokens of all of a request's prompts (default: %(default)s)")
    p.add_argument("--max-waiting-requests", type=int, default=defaults.max_waiting_requests,
                   help="requests that may wait beyond a full batch; more get a 503 "
                        "(default: %(default)s)")
    p.add_argument("--tool-call-parser", default=defaults.tool_call_parser,
                   choices=sorted(TOOL_PARSERS),
                   help="how tool calls are read from outputs (default: %(default)s)")
    p.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS),
                   help="split a reasoning model's reasoning from its answer "
                        "(reasoning_content; default: none)")
    p.add_argument("--shutdown-grace", type=float, default=defaults.shutdown_grace_s,
                   help="seconds streams in flight may run after SIGTERM (default: %(default)s)")
    p.add_argument("--api-server-count", type=int, default=default_api_server_count(),
                   help="API-server processes on one port, sharing one engine core (default: "
                        "one per four cores, at most four: %(default)s here)")


def server_args(args: argparse.Namespace) -> ServerArgs:
    return ServerArgs(api_key=args.api_key or os.environ.get("LITEINFER_API_KEY"),
                      metrics_need_key=args.metrics_need_key,
                      max_body_bytes=args.max_body_bytes,
                      max_prompts_per_request=args.max_prompts_per_request,
                      max_prompt_tokens_per_request=args.max_prompt_tokens_per_request,
                      max_waiting_requests=args.max_waiting_requests,
                      shutdown_grace_s=args.shutdown_grace,
                      tool_call_parser=args.tool_call_parser,
                      reasoning_parser=args.reasoning_parser,
                      api_server_count=args.api_server_count)
