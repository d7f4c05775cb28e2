"""The API server's middleware, as plain ASGI: API-key check and the server tag, the last
resort that turns an unexpected exception into an OpenAI-shaped 500, and the request counter.

Starlette's `BaseHTTPMiddleware` (what `@app.middleware("http")` builds) pipes every streamed
body through an extra task and a memory stream; profiled at 32 concurrent streams it took a fifth
of an API server's CPU, which on a small machine is taken from the engine. Wrapping `send`
costs one function call per message.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rankcast.api_server.errors import error_response
from rankcast.api_server.metrics.prometheus import ServerMetrics

logger = logging.getLogger(__name__)

# Routes that need the API key when one is set.
PROTECTED_PREFIXES = ("/v1", "/collective_rpc", "/reset_prefix_cache")

# The probes vLLM's API server leaves out of its request counter (a scrape or a health check
# counted would change the counter it reads).
UNCOUNTED = frozenset(("/metrics", "/health", "/load", "/ping", "/version"))
# What vLLM's counter (prometheus-fastapi-instrumentator) names a request no route matched.
UNMATCHED = "none"


class TagAndAuthenticate:
    """Answers 401 to a protected route without the key (`Authorization: Bearer KEY`, or
    `x-api-key: KEY` as Anthropic's clients send it); tags every response with the index of the
    API server that answered (siblings share a port, so clients and tests can tell)."""

    def __init__(self, app: ASGIApp, index: int, api_key: str | None) -> None:
        self.app = app
        self.tag = (b"x-rankcast-api-server", str(index).encode())
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.tag]
            await send(message)

        if self.expected is not None and scope["path"].startswith(PROTECTED_PREFIXES):
            headers: list[tuple[bytes, Any]] = scope["headers"]
            bearer = next((v for k, v in headers if k == b"authorization"), None)
            key = next((v for k, v in headers if k == b"x-api-key"), None)
            if bearer != self.expected and key != self.key:
                refusal = error_response(401, "Invalid or missing API key.", path=scope["path"])
                await refusal(scope, receive, tagged)
                return
        await self.app(scope, receive, tagged)


class LastResortErrors:
    """Any exception a route did not turn into a response becomes a JSON 500 in the OpenAI
    error shape with a request id, and one log line (with the traceback) carries the same id, so
    an operator can find what a client reports. Without it the client would get Starlette's
    plain-text "Internal Server Error" and the log no way to match it.

    A response that has already started (a stream) cannot change its status: the error is
    logged with its id and the connection is closed by re-raising.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:
            request_id = f"req-{uuid.uuid4().hex}"
            logger.exception(
                "request %s (%s %s) failed", request_id, scope.get("method"), scope.get("path")
            )
            if started:
                raise
            response = error_response(
                500,
                f"Internal server error (request id {request_id}); the server log has it.",
                path=scope.get("path", ""),
            )
            response.headers["x-request-id"] = request_id
            await response(scope, receive, send)


class CountRequests:
    """Counts every request as vLLM's API server does (`http_requests_total`, from
    prometheus-fastapi-instrumentator), summed over the fleet's API servers with the other
    series each server counts itself: by method, status class ("2xx", "4xx", ...) and route
    template, the one the router matched (`scope["route"]`, set as the app ran: a parameter's
    route once, whatever the parameter). A path no route matched, and a request answered before
    any route ran (the API-key check, a stopping server), is "none". A stream is counted once
    it has ended, with the status it started with; a request whose app raised, with what was
    sent, 500 if nothing was. The Rust API server counts the same way
    (rust/frontend/src/route_metrics.rs)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNCOUNTED:
            await self.app(scope, receive, send)
            return
        status = 500

        async def tracked(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        finally:
            route = scope.get("route")
            handler = getattr(route, "path", None) or UNMATCHED
            self.metrics.record_http_request(scope["method"], f"{str(status)[0]}xx", handler)
