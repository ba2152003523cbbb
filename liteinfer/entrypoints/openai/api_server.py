"""An OpenAI-compatible HTTP server: /v1/completions and /v1/chat/completions (streamed as
server-sent events or whole), /v1/models and /v1/models/{id}, /health (readiness), /livez
(liveness), /metrics (Prometheus), and vLLM's /version, /tokenize and /detokenize, over an
AsyncLLM (whose engine core runs in a process of its own). OpenAI's Responses API
(responses.py) and Anthropic's Messages API (entrypoints/anthropic/) run on the chat path and
are routed here.

Every HTTP request becomes one engine request per prompt and choice, all admitted together or
not at all. Bad input of any kind (a body too large, malformed JSON, a field out of range, text
the tokenizer rejects) is answered with an OpenAI-style 4xx before anything reaches the engine,
so it never disturbs the requests already running; so is every other error the framework raises
(404, 405). A client that disconnects has its requests aborted and their KV blocks returned.

    liteinfer serve --model DIR_OR_NAME [--port 8000] [--api-key KEY]

With an API key, every route but /health and /livez (and /metrics, unless --metrics-need-key)
needs `Authorization: Bearer KEY`. On SIGTERM the server refuses new requests with a 503, lets
the streams in flight finish for a grace period, ends the rest with an error, and exits. /health
answers 200 only while requests are admitted: a 503 while shutting down, once the engine core
died, and while any API-server process is down; /livez answers 200 while the process does.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import multiprocessing
import multiprocessing.connection as mp_connection
import os
import secrets
import selectors
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from liteinfer import __version__
from liteinfer.config import EngineConfig
from liteinfer.engine.async_llm import AsyncLLM
from liteinfer.engine.core_process import CoreHandle, CoreProcess
from liteinfer.entrypoints.anthropic.protocol import ANTHROPIC_PATH, anthropic_error_body
from liteinfer.entrypoints.anthropic.serving import AnthropicServing
from liteinfer.entrypoints.openai.cli_args import ServerArgs
from liteinfer.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from liteinfer.entrypoints.openai.responses import OpenAIServingResponses
from liteinfer.entrypoints.openai.serving import (
    Body,
    OpenAIServing,
    Readiness,
    RequestError,
    ServerShuttingDown,
    error_body,
    json_response,
    parse,
)
from liteinfer.loader.overrides import ModelOverrides
from liteinfer.logger import configure_logging, logging_level
from liteinfer.utils import freeze_heap, model_label

logger = logging.getLogger(__name__)


def error_response(status: int, message: str, path: str = "") -> Response:
    """An error in the shape of the API `path` belongs to (Anthropic's on its routes)."""
    body = (anthropic_error_body if path.startswith(ANTHROPIC_PATH) else error_body)(status,
                                                                                    message)
    return Response(orjson.dumps(body), status, media_type="application/json")


async def read_json(request: Request, limit: int) -> Any:
    """The request's JSON body, refused (413) as soon as it is known to exceed `limit` bytes:
    from its Content-Length, or while it arrives."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"the request body exceeds the server's {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"the request body exceeds the server's {limit} bytes")
        chunks.append(chunk)
    try:
        return orjson.loads(b"".join(chunks))
    except orjson.JSONDecodeError as e:  # also invalid UTF-8, lone surrogates, deep nesting
        raise RequestError(400, f"the request body is not valid JSON: {e}") from None


class APIKeyGuard:
    """ASGI middleware: a 401 for any route but the open ones without the key, given as a
    bearer token or (as Anthropic's clients send it) in `x-api-key`."""

    def __init__(self, app: Any, api_key: str, open_paths: frozenset[str]):
        self.app, self.open_paths = app, open_paths
        self.key, self.expected = api_key.encode(), f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            headers = dict(scope["headers"])
            if not (secrets.compare_digest(headers.get(b"authorization", b""), self.expected)
                    or secrets.compare_digest(headers.get(b"x-api-key", b""), self.key)):
                await error_response(401, "invalid or missing API key", scope["path"])(
                    scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncLLM, model_name: str, args: ServerArgs | None = None,
              readiness: Readiness | None = None) -> Starlette:
    """The ASGI app; its lifespan binds the engine client to the serving event loop. Plain
    Starlette: requests are parsed by the protocol's models, so FastAPI's layers over it
    (dependency solving, its middlewares) would only add to every request's path (journal
    item 67)."""
    args = args or ServerArgs()
    serving = OpenAIServing(engine, model_name, args, readiness)
    responses_api = OpenAIServingResponses(serving)
    anthropic_api = AnthropicServing(serving)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await engine.start()
        freeze_heap()  # the tokenizer and the app, as the engine core freezes its own heap
        serving.readiness.set(True)
        try:
            yield
        finally:
            serving.readiness.set(False)
            await engine.stop()

    async def request_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestError)
        return error_response(exc.status, str(exc), request.url.path)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error_response(exc.status_code, str(exc.detail), request.url.path)

    async def internal_error(request: Request, exc: Exception) -> Response:
        return error_response(500, f"internal error ({type(exc).__name__})", request.url.path)

    async def body_of(request: Request, model: type[Body]) -> Body:
        return parse(model, await read_json(request, args.max_body_bytes))

    async def health(_: Request) -> Response:
        reason = serving.unready()
        if reason is not None:
            return error_response(503, reason)
        return json_response({"status": "ok"})

    async def livez(_: Request) -> Response:
        return json_response({"status": "alive"})

    async def metrics(_: Request) -> Response:
        return Response(serving.metrics.render(), media_type=serving.metrics.content_type)

    async def version(_: Request) -> Response:
        return json_response({"version": __version__})

    async def models(_: Request) -> Response:
        return json_response(serving.models())

    async def model(request: Request) -> Response:
        return json_response(serving.model(request.path_params["model_id"]))

    async def completions(request: Request) -> Response:
        return await serving.completions(await body_of(request, CompletionRequest), request)

    async def chat(request: Request) -> Response:
        return await serving.chat(await body_of(request, ChatCompletionRequest), request)

    async def responses(request: Request) -> Response:
        return await responses_api.create(await read_json(request, args.max_body_bytes),
                                          request)

    async def stored_response(request: Request) -> Response:
        return json_response(await responses_api.retrieve(request.path_params["response_id"]))

    async def messages(request: Request) -> Response:
        return await anthropic_api.messages(await read_json(request, args.max_body_bytes),
                                            request)

    async def count_tokens(request: Request) -> Response:
        return json_response(await anthropic_api.count_tokens(
            await read_json(request, args.max_body_bytes)))

    async def tokenize(request: Request) -> Response:
        return json_response(await serving.tokenize(await body_of(request, TokenizeRequest)))

    async def detokenize(request: Request) -> Response:
        return json_response(await serving.detokenize(await body_of(request, DetokenizeRequest)))

    middleware = []
    if args.api_key:
        open_paths = frozenset({"/health", "/livez"} | (set() if args.metrics_need_key
                                                         else {"/metrics"}))
        middleware.append(Middleware(APIKeyGuard, api_key=args.api_key, open_paths=open_paths))
    app = Starlette(
        # Matched in order: the generation routes, where latency counts, come first.
        routes=[Route("/v1/completions", completions, methods=["POST"]),
                Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/v1/responses", responses, methods=["POST"]),
                Route("/v1/responses/{response_id}", stored_response),
                Route("/v1/messages", messages, methods=["POST"]),
                Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
                Route("/health", health), Route("/livez", livez), Route("/metrics", metrics),
                Route("/version", version), Route("/v1/models", models),
                Route("/v1/models/{model_id:path}", model),
                Route("/tokenize", tokenize, methods=["POST"]),
                Route("/detokenize", detokenize, methods=["POST"])],
        middleware=middleware,
        exception_handlers={RequestError: request_error, HTTPException: http_error,
                            Exception: internal_error},
        lifespan=lifespan)
    app.state.serving = serving
    return app


async def drain(serving: OpenAIServing, grace_s: float) -> None:
    """Refuses new requests, lets those in flight run for `grace_s`, then ends the rest."""
    serving.draining = True
    serving.readiness.set(False)  # the other API servers' /health answers 503 too
    deadline = time.monotonic() + grace_s
    while serving.engine.num_requests and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    serving.engine.fail_all(ServerShuttingDown("the server is shutting down"))
    await asyncio.sleep(0.1)  # let the error events reach their clients


class Server:
    """uvicorn serving the app, with a shutdown that drains (SIGTERM, SIGINT, or a dead core)
    instead of cutting streams off. `ignored_signals` are left to the process that started
    this one (API-server processes leave Ctrl-C to their parent)."""

    def __init__(self, app: Starlette, config: Any, ignored_signals: frozenset[int] = frozenset()):
        import uvicorn

        outer = self

        class DrainingServer(uvicorn.Server):
            def handle_exit(self, sig: int, frame: Any) -> None:
                if sig in ignored_signals:
                    return
                if outer.draining is not None:  # a second signal: stop now
                    self.force_exit = self.should_exit = True
                    return
                if outer.loop is not None:
                    outer.loop.call_soon_threadsafe(outer.begin_drain)

        self.app = app
        self.serving: OpenAIServing = app.state.serving
        self.uvicorn = DrainingServer(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining: asyncio.Task[None] | None = None
        self.serving.engine.on_death.append(
            lambda: self.loop is not None and self.loop.call_soon_threadsafe(self.begin_drain))

    def begin_drain(self) -> None:
        if self.draining is None:
            grace = self.serving.args.shutdown_grace_s if self.serving.engine.dead is None else 0
            self.draining = asyncio.ensure_future(self._drain(grace))

    async def _drain(self, grace_s: float) -> None:
        await drain(self.serving, grace_s)
        self.uvicorn.should_exit = True

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await self.uvicorn.serve(sockets)

    def run(self, sockets: list[socket.socket] | None = None) -> None:
        """Serves on uvicorn's event loop (uvloop where installed) until shut down."""
        with asyncio.Runner(loop_factory=self.uvicorn.config.get_loop_factory()) as runner:
            runner.run(self.serve(sockets))


def uvicorn_config(app: Starlette, host: str, port: int, log_level: str | None = None) -> Any:
    """uvloop and httptools where installed, else asyncio and h11. uvicorn logs through
    liteinfer's handler (logger.py), at `log_level` or else --log-level."""
    import importlib.util

    import uvicorn

    fast = {"loop": "uvloop"} if importlib.util.find_spec("uvloop") else {}
    if importlib.util.find_spec("httptools"):
        fast["http"] = "httptools"
    return uvicorn.Config(app, host=host, port=port, log_level=log_level or logging_level(),
                          log_config=None, timeout_graceful_shutdown=5, **fast)


def run_server(model: str, host: str = "127.0.0.1", port: int = 8000,
               served_model_name: str | None = None, load_format: str = "auto",
               args: ServerArgs | None = None, overrides: ModelOverrides | None = None,
               **engine_args: Any) -> None:
    """overrides: a chat template and generation config in place of the model's."""
    args = args or ServerArgs()
    overrides = overrides or ModelOverrides()
    name = served_model_name or model_label(model)
    if args.api_server_count > 1:
        run_api_servers(model, host, port, name, load_format, args, overrides, **engine_args)
        return
    # Before loading: a port in use fails at once.
    socks = listening_sockets(host, port, 1, reuse_port=False)
    log_address(socks[0])
    try:
        with StartingResponder(socks):
            engine = AsyncLLM.from_args(model, load_format, args.max_waiting_requests,
                                        **engine_args)
        serve_engine(engine, name, args, overrides, host, port, socks)
    finally:
        for sock in socks:
            sock.close()


def log_address(sock: socket.socket) -> None:
    """The address the server listens on, logged as it is bound: with `--port 0` this line is
    where a caller learns the port the kernel chose."""
    host, port = sock.getsockname()[:2]
    logger.info("listening on http://%s:%d", f"[{host}]" if ":" in host else host, port)


def serve_engine(engine: AsyncLLM, name: str, args: ServerArgs, overrides: ModelOverrides,
                 host: str, port: int, sockets: list[socket.socket] | None = None,
                 ignored_signals: frozenset[int] = frozenset(),
                 readiness: Readiness | None = None) -> None:
    """Serves `engine` until shut down (on `sockets` when given, else it binds host:port),
    then shuts it down; a dead engine is the process's error."""
    try:
        overrides.apply(engine)
        app = build_app(engine, name, args, readiness)
        Server(app, uvicorn_config(app, host, port), ignored_signals).run(sockets)
    finally:
        engine.shutdown()
    if engine.dead is not None:
        raise SystemExit(f"error: {engine.dead}")


# ---- several API-server processes on one engine core ---------------------------------------
def listening_sockets(host: str, port: int, n: int, reuse_port: bool = True
                      ) -> list[socket.socket]:
    """n listening sockets on one port (SO_REUSEPORT, which one server alone leaves off: it
    would let a second server share the port). The kernel spreads new connections evenly over
    them; processes sharing one socket would not (an event loop that wakes up accepts every
    connection waiting, so one process takes a burst of them)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            # IPPROTO_TCP named, not left 0: asyncio turns Nagle's algorithm off only on sockets
            # whose protocol says TCP, and with it on a streamed token waits for the client's
            # delayed ACK (~40 ms on a kept-alive connection).
            sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, reuse_port)
            sock.bind((host, port))
            port = sock.getsockname()[1]  # port 0: the others join the one the first got
            sock.listen(2048)
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks


class StartingResponder:
    """While the engine core loads and the API servers start, answers every connection on the
    server's listening sockets with a 503 in OpenAI's shape, instead of leaving it unanswered in
    the backlog: /health tells the truth from the moment the port is bound. A thread, until
    `stop()` or until `done()` holds (the API servers accept on the same sockets by then)."""

    def __init__(self, socks: list[socket.socket], done: Callable[[], bool] = lambda: False):
        self.socks, self.done = socks, done
        self.stopped = threading.Event()
        for sock in socks:  # an API server may take a connection this thread was woken for
            sock.setblocking(False)
        self.thread = threading.Thread(target=self._run, name="liteinfer-starting", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = orjson.dumps(error_body(503, "the server is starting"))
        response = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body)
        with selectors.DefaultSelector() as selector:
            for sock in self.socks:
                selector.register(sock, selectors.EVENT_READ)
            while not self.stopped.is_set() and not self.done():
                for key, _ in selector.select(0.05):
                    with contextlib.suppress(OSError):  # taken by an API server, or a reset
                        conn, _ = key.fileobj.accept()  # type: ignore[union-attr]
                        with conn:
                            conn.settimeout(1.0)
                            conn.recv(65536)  # the request's head
                            conn.sendall(response)
                            conn.shutdown(socket.SHUT_WR)
        self.stopped.set()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()

    def __enter__(self) -> StartingResponder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_api_server_process(model: str, config: EngineConfig, core: CoreHandle,
                           load_format: str, client_index: int, sock: socket.socket | None,
                           address: tuple[str, int], name: str, args: ServerArgs,
                           overrides: ModelOverrides, ready: Any) -> None:
    """An API-server process: front end `client_index` of the core, serving on `sock`, else
    (a replacement) on a socket of its own at `address`, bound once it can serve so that no
    connection waits for it meanwhile; `ready` holds every API server's readiness flag."""
    configure_logging()
    engine = AsyncLLM(model, config, core, load_format, client_index)
    host, port = address
    if sock is None:
        (sock,) = listening_sockets(host, port, 1)
    serve_engine(engine, name, args, overrides, host, port, [sock], frozenset({signal.SIGINT}),
                 Readiness(ready, client_index))


# An API-server process that dies is replaced, unless this many died in the last window: then
# something kills them faster than they serve, and the server exits.
MAX_RESTARTS, RESTART_WINDOW_S = 3, 60.0


class RestartBudget:
    """At most MAX_RESTARTS replacements in any RESTART_WINDOW_S."""

    def __init__(self) -> None:
        self.times: collections.deque[float] = collections.deque()

    def take(self, now: float) -> bool:
        while self.times and now - self.times[0] > RESTART_WINDOW_S:
            self.times.popleft()
        if len(self.times) >= MAX_RESTARTS:
            return False
        self.times.append(now)
        return True


def run_api_servers(model: str, host: str, port: int, name: str, load_format: str,
                    args: ServerArgs, overrides: ModelOverrides, **engine_args: Any) -> None:
    """`args.api_server_count` API-server processes, each front end of one engine core and
    listening on the same port. SIGTERM or SIGINT here drains them all. An API server that
    dies has its requests ended in the core and is replaced, the others serving meanwhile
    (within a RestartBudget). When the core dies the API servers end their streams with an
    error and exit, and so does this process. /metrics counts every process's requests
    (prometheus_client's multiprocess mode)."""
    n = args.api_server_count
    config = EngineConfig(**engine_args)
    socks = listening_sockets(host, port, n)  # before loading: a port in use fails at once
    port = socks[0].getsockname()[1]
    log_address(socks[0])
    metrics_dir = tempfile.mkdtemp(prefix="liteinfer-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # read by the children's imports
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Array("b", n, lock=False)  # each API server sets its own; this process clears
    procs: dict[int, multiprocessing.process.BaseProcess] = {}
    stopping = False

    def stop(sig: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True
        ready[:] = [0] * n
        for proc in procs.values():  # a second signal reaches them too: they stop at once
            if proc.pid is not None and proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    responder: StartingResponder | None = StartingResponder(socks, lambda: all(ready))
    core = None
    core_died = False
    failed: str | None = None
    try:
        core = CoreProcess(model, config, load_format, n, args.max_waiting_requests)

        def start(i: int, sock: socket.socket | None) -> None:
            assert core is not None
            procs[i] = ctx.Process(target=run_api_server_process,
                                   name=f"liteinfer-api-server-{i}",
                                   args=(model, config, core.handle, load_format, i, sock,
                                         (host, port), name, args, overrides, ready))
            procs[i].start()

        for i, sock in enumerate(socks):
            if stopping:  # a signal while the model loaded
                break
            start(i, sock)
        budget = RestartBudget()
        while not stopping and failed is None:
            # Until a child exits or the core does. (Sentinels, not is_alive(): a process
            # closes its pipes before it can be reaped.)
            ended = mp_connection.wait([p.sentinel for p in procs.values()]
                                       + [core.proc.sentinel],
                                       None if responder is None else 0.1)
            if responder is not None and responder.stopped.is_set():
                # Every API server serves: this process's copies of their sockets go, so that
                # the kernel stops sending connections to the socket of one that dies.
                responder.stop()
                responder = None
                for sock in socks:
                    sock.close()
            if stopping:
                break
            if core.proc.sentinel in ended or mp_connection.wait([core.proc.sentinel], 0):
                core_died = True
                break
            for i, proc in list(procs.items()):
                if proc.sentinel not in ended:
                    continue
                ready[i] = 0
                proc.join()
                core.abort_client(i)  # its clients are gone
                if not budget.take(time.monotonic()):
                    failed = (f"{MAX_RESTARTS + 1} API-server processes died within "
                              f"{RESTART_WINDOW_S:.0f} s")
                    break
                logger.warning("%s exited (code %s); starting another", proc.name,
                               proc.exitcode)
                start(i, None)
        if not core_died and not stopping:  # too many deaths: the others drain
            stop(signal.SIGTERM, None)
        deadline = time.monotonic() + args.shutdown_grace_s + 10
        for proc in procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if responder is not None:
            responder.stop()
        for sock in socks:
            sock.close()
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
        if core is not None:
            core.shutdown()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    if core_died:
        raise SystemExit("error: the engine core process died")
    if failed:
        raise SystemExit(f"error: {failed}")
