"""The load generator's HTTP client against a real HTTP server (uvicorn running a Starlette app,
as `liteinfer serve` does): streamed lines arrive as they are sent, error bodies are read
whole, kept-alive connections are reused, and a response cut off mid-stream is an error."""
from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from liteinfer.bench.http_client import StreamingClient
from liteinfer.entrypoints.openai.api_server import listening_sockets

GAP_S = 0.05  # between the streamed lines


async def stream(request: Request) -> StreamingResponse:
    lines = int((await request.body()).decode())
    peer = request.scope["client"]

    async def events() -> AsyncIterator[bytes]:
        for i in range(lines):
            # A line split over two writes, which the client must join.
            yield f"data: {i} ".encode()
            yield f"{peer[1]} {request.headers.get('x-key')}\n\n".encode()
            await asyncio.sleep(GAP_S)

    return StreamingResponse(events(), media_type="text/event-stream")


async def refuse(request: Request) -> PlainTextResponse:
    return PlainTextResponse("no such thing " * 100, status_code=404)


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    app = Starlette(routes=[Route("/v1/stream", stream, methods=["POST"]),
                            Route("/v1/refuse", refuse, methods=["POST"])])
    # Bound now, as `liteinfer serve` binds: a free port picked first could be taken meanwhile.
    (sock,) = listening_sockets("127.0.0.1", 0, 1, reuse_port=False)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, args=([sock],), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(10)
    sock.close()


def test_lines_stream_as_sent_over_one_kept_alive_connection(base_url):
    async def go() -> list[tuple[float, bytes]]:
        client = StreamingClient(base_url, {"x-key": "k1"}, read_timeout=10)
        got = []
        try:
            for _ in range(2):
                async with client.post("/stream", b"3") as resp:
                    assert resp.status == 200
                    got += [(time.perf_counter(), line) async for line in resp.lines()]
        finally:
            await client.close()
        return got

    got = asyncio.run(go())
    lines = [line for _, line in got if line.strip()]
    ports = {line.split()[2] for line in lines}
    assert len(ports) == 1  # the second request reused the first one's connection
    assert [line.split()[1] for line in lines] == [b"0", b"1", b"2"] * 2
    assert all(line.endswith(b" k1\n") and line.startswith(b"data: ") for line in lines)
    # Each line came when it was sent, not at the end of its response.
    times = [t for t, line in got if line.strip()]
    assert all(b - a > GAP_S * 0.5 for a, b in itertools.pairwise(times))


def test_an_error_status_comes_with_its_whole_body(base_url):
    async def go() -> tuple[int, bytes]:
        client = StreamingClient(base_url, {}, read_timeout=10)
        try:
            async with client.post("/refuse", b"") as resp:
                return resp.status, await resp.read()
        finally:
            await client.close()

    status, body = asyncio.run(go())
    assert status == 404 and body == b"no such thing " * 100


def test_a_connection_cut_mid_response_raises():
    """A server that sends headers and part of a chunked body, then closes."""
    async def go() -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"8\r\ndata: 1\n\r\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = StreamingClient(f"http://127.0.0.1:{port}", {}, read_timeout=10)
        lines = []
        with pytest.raises(ConnectionError):
            async with client.post("/x", b"{}") as resp:
                async for line in resp.lines():
                    lines.append(line)
        assert lines == [b"data: 1\n"]
        assert client._idle == []  # the broken connection is not reused
        server.close()

    asyncio.run(go())


def test_a_silent_server_times_out():
    async def go() -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await asyncio.sleep(5)

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = StreamingClient(f"http://127.0.0.1:{port}", {}, read_timeout=0.2)
        with pytest.raises(TimeoutError):
            async with client.post("/x", b"{}"):
                pass
        server.close()

    asyncio.run(go())


def test_only_http_urls():
    with pytest.raises(ValueError, match="expected http"):
        StreamingClient("ftp://host/", {}, 1.0)
