"""`liteinfer serve`'s flags: where to listen, the API key, and the server's limits (importable
without the ASGI stack, so that the CLI parses without it)."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from liteinfer.entrypoints.arg_utils import (
    CHOICES,
    CLI_DEFAULT,
    FLAG,
    SHOWN_DEFAULT,
    add_dataclass_args,
    dataclass_kwargs,
)
from liteinfer.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from liteinfer.entrypoints.openai.tool_parsers import TOOL_PARSERS


def default_api_server_count() -> int:
    """One front-end process per four cores, up to four: enough to stream 128 requests at a
    step every couple of milliseconds (one event per request per step), leaving cores for the
    engine core and the clients."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


@dataclass
class ServerArgs:
    """The server's limits and switches: each field is a `liteinfer serve` flag, its comment
    the flag's help (entrypoints/arg_utils.py)."""

    # require `Authorization: Bearer KEY` on every route but /health and /livez
    api_key: str | None = field(default=None, metadata={
        SHOWN_DEFAULT: "$LITEINFER_API_KEY, if set"})
    # with --api-key, /metrics needs the key too
    metrics_need_key: bool = field(default=False, metadata={SHOWN_DEFAULT: "open"})
    max_body_bytes: int = 8 * 2**20  # larger request bodies get a 413
    max_prompts_per_request: int = 256  # prompts one request may carry
    max_prompt_tokens_per_request: int = 2**20  # prompt tokens of all of a request's prompts
    # requests that may wait beyond a full batch; more get a 503
    max_waiting_requests: int = 1024
    # seconds streams in flight may run after SIGTERM
    shutdown_grace_s: float = field(default=5.0, metadata={FLAG: "--shutdown-grace"})
    # how tool calls are read from outputs under tool_choice "auto" (tool_parsers/)
    tool_call_parser: str = field(default="llama3_json", metadata={
        CHOICES: sorted(TOOL_PARSERS)})
    # split a reasoning model's reasoning from its answer (reasoning_content)
    reasoning_parser: str | None = field(default=None, metadata={
        CHOICES: sorted(REASONING_PARSERS), SHOWN_DEFAULT: "none"})
    # API-server processes on one port, sharing one engine core (a process can stream only so
    # many events)
    api_server_count: int = field(default=1, metadata={
        CLI_DEFAULT: default_api_server_count,
        SHOWN_DEFAULT: "one per four cores, at most four: {} here"})


def add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000,
                   help="0: a free port, which the log line `listening on URL` names (at "
                        "--log-level info, the default)")
    p.add_argument("--served-model-name", help="the model's name in the API (default: the "
                                               "model's name or its directory's)")
    add_dataclass_args(p.add_argument_group("server arguments (ServerArgs)"), ServerArgs)


def server_args(args: argparse.Namespace) -> ServerArgs:
    kwargs = dataclass_kwargs(args, ServerArgs)
    kwargs["api_key"] = kwargs.get("api_key") or os.environ.get("LITEINFER_API_KEY")
    return ServerArgs(**kwargs)
