"""A streaming HTTP client light enough to share two cores with the server it measures.

The benchmarks' clients run on the machine they measure, so every microsecond they spend per
streamed token is taken from the engine (on two cores, from its matrix multiplies). aiohttp
spent ~25 us per token at 32 streams: its stream reader wakes a coroutine per line. Here a
token costs one `data_received` call: httptools (uvicorn's C parser) takes the chunked
response apart, and the server-sent events in it are handed to a callback as they complete,
with the time they arrived. h11 writes the request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, cast
from urllib.parse import urlsplit

import h11
import httptools
import msgspec

# (event bytes without the trailing blank line, the perf_counter time its data arrived)
OnEvent = Callable[[bytes, float], None]

_encode = msgspec.json.Encoder().encode


class StreamError(RuntimeError):
    """The server answered with an error status (its body is in the message)."""


class _StreamedResponse(asyncio.Protocol):
    """One request's connection: parses the response and splits its body into events."""

    def __init__(self, request: bytes, on_event: OnEvent, done: asyncio.Future[None]) -> None:
        self.request = request
        self.on_event = on_event
        self.done = done
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.pending = b""
        self.error_body = b""
        self.transport: asyncio.Transport | None = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._finish(StreamError(f"unreadable response: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish(ConnectionError(f"the server closed the stream early ({exc})"))

    # httptools callbacks

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.status != 200:
            self.error_body += body
            return
        self.pending += body
        if b"\n\n" not in self.pending:
            return
        *events, self.pending = self.pending.split(b"\n\n")
        now = time.perf_counter()
        for event in events:
            self.on_event(event, now)

    def on_message_complete(self) -> None:
        if self.status != 200:
            text = self.error_body.decode(errors="replace")
            self._finish(StreamError(f"HTTP {self.status}: {text}"))
        else:
            self._finish(None)

    def _finish(self, error: Exception | None) -> None:
        if not self.done.done():
            if error is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(error)
        if self.transport is not None:
            self.transport.close()


class SSEClient:
    """Streaming POSTs to one server, at most `connections` at a time (each on a connection of
    its own, closed at the end: opening one is ~0.1 ms against a stream of seconds). A stream
    that has not ended after `timeout_s` raises TimeoutError: a stuck server fails the
    benchmark instead of hanging it."""

    def __init__(self, url: str, connections: int, timeout_s: float = 900.0) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.gate = asyncio.Semaphore(connections)
        self.timeout_s = timeout_s

    async def __aenter__(self) -> SSEClient:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        return None

    def _request(self, path: str, body: dict[str, Any]) -> bytes:
        payload = _encode(body)
        http = h11.Connection(h11.CLIENT)
        headers = [
            ("Host", f"{self.host}:{self.port}"),
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(payload))),
            ("Connection", "close"),
        ]
        head = http.send(h11.Request(method="POST", target=path, headers=headers))
        data = http.send(h11.Data(data=payload))
        end = http.send(h11.EndOfMessage())
        return b"".join(part or b"" for part in (head, data, end))

    async def stream(self, path: str, body: dict[str, Any], on_event: OnEvent) -> None:
        """POST `body` and feed each server-sent event of the answer to `on_event`; returns
        when the response ends, raises StreamError for an error status."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        request = self._request(path, body)
        async with self.gate:
            transport, _ = await loop.create_connection(
                lambda: _StreamedResponse(request, on_event, done), self.host, self.port
            )
            try:
                await asyncio.wait_for(done, self.timeout_s)
            finally:
                transport.close()
