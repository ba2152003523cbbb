"""The load generator's HTTP/1.1 client: POST a body, stream the response's lines.

asyncio streams for the connection and httptools (llhttp) for the response. aiohttp's client
spends a fraction of a millisecond of Python on each request before its bytes leave
(docs/notes/journal.md, item 77), and all of it lands inside every TTFT the load generator
reports.
Connections are kept alive and reused, one per request in flight.
"""
from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httptools

READ_SIZE = 1 << 16


@dataclass
class _Message:
    """What the parser has seen of one response; its callbacks' object."""

    body: bytearray = field(default_factory=bytearray)
    headers_done: bool = False
    framed: bool = False  # a Content-Length or chunked body; else the body ends with the stream
    closing: bool = False  # `Connection: close`
    complete: bool = False

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name in (b"content-length", b"transfer-encoding"):
            self.framed = True
        elif name == b"connection" and value.lower() == b"close":
            self.closing = True

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.complete = True


class Response:
    """One response: `status`, then its body line by line (`lines`) or whole (`read`)."""

    def __init__(self, reader: asyncio.StreamReader, parser: httptools.HttpResponseParser,
                 message: _Message, read_timeout: float) -> None:
        self.status = 0
        self._reader, self._parser, self._message = reader, parser, message
        self._read_timeout = read_timeout

    async def read_headers(self) -> None:
        """Reads until the headers are in; sets `status`."""
        while not self._message.headers_done:
            await self._feed()
        self.status = self._parser.get_status_code()

    async def _feed(self) -> bool:
        """Reads more of the response into the parser; False once the message is complete."""
        if self._message.complete:
            return False
        async with asyncio.timeout(self._read_timeout):
            data = await self._reader.read(READ_SIZE)
        if not data:
            if self._message.headers_done and not self._message.framed:
                self._message.complete = True
                return False
            raise ConnectionError("the server closed the connection mid-response")
        self._parser.feed_data(data)
        return True

    async def lines(self) -> AsyncIterator[bytes]:
        """The body's lines, each with its b"\\n", as they arrive."""
        body = self._message.body
        while True:
            end = body.find(b"\n")
            while end >= 0:
                yield bytes(body[:end + 1])
                del body[:end + 1]
                end = body.find(b"\n")
            if not await self._feed():
                break
        if body:
            yield bytes(body)
            body.clear()

    async def read(self) -> bytes:
        while await self._feed():
            pass
        data = bytes(self._message.body)
        self._message.body.clear()
        return data


@dataclass
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter


class StreamingClient:
    """POSTs to one server (`base_url`: http or https), with `headers` on every request."""

    def __init__(self, base_url: str, headers: dict[str, str], read_timeout: float) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"{base_url!r}: expected http://host[:port] or https://...")
        self.host = url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if url.scheme == "https" else None
        self.prefix = url.path.rstrip("/")
        self.read_timeout = read_timeout
        host = self.host if url.port is None else f"{self.host}:{self.port}"
        self._headers = "".join(f"{k}: {v}\r\n" for k, v in
                                {"Host": host, **headers}.items()).encode("latin-1")
        self._idle: list[_Connection] = []

    async def _open(self) -> _Connection:
        reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self.ssl,
                                                       limit=READ_SIZE)
        return _Connection(reader, writer)

    @asynccontextmanager
    async def post(self, path: str, body: bytes) -> AsyncIterator[Response]:
        """Sends the request and yields its response once the headers are in. The connection
        goes back to the pool if the response was read to its end and the server keeps it
        alive (HTTP/1.1's default); otherwise it is closed."""
        conn = self._idle.pop() if self._idle else await self._open()
        keep = False
        try:
            conn.writer.write(b"POST " + (self.prefix + path).encode() + b" HTTP/1.1\r\n"
                              + self._headers + b"Content-Length: " + str(len(body)).encode()
                              + b"\r\n\r\n" + body)
            message = _Message()
            parser = httptools.HttpResponseParser(message)
            response = Response(conn.reader, parser, message, self.read_timeout)
            await response.read_headers()
            yield response
            keep = message.complete and message.framed and not message.closing
        finally:
            if keep:
                self._idle.append(conn)
            else:
                conn.writer.close()

    async def close(self) -> None:
        for conn in self._idle:
            conn.writer.close()
        self._idle.clear()

