"""The API server's one middleware, as plain ASGI: API-key check and the server tag.

Starlette's `BaseHTTPMiddleware` (what `@app.middleware("http")` builds) pipes every streamed
body through an extra task and a memory stream; profiled at 32 concurrent streams it took a fifth
of an API server's CPU, which on a small machine is taken from the engine. Wrapping `send`
costs one function call per message.
"""

from __future__ import annotations

from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rankcast.entrypoints.openai.errors import error_response

# Routes that need the API key when one is set.
PROTECTED_PREFIXES = ("/v1", "/collective_rpc", "/reset_prefix_cache")


class TagAndAuthenticate:
    """Answers 401 to a protected route without the key; tags every response with the index of
    the API server that answered (siblings share a port, so clients and tests can tell)."""

    def __init__(self, app: ASGIApp, index: int, api_key: str | None) -> None:
        self.app = app
        self.tag = (b"x-rankcast-api-server", str(index).encode())
        self.expected = f"Bearer {api_key}".encode() if api_key else None

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
            given = next((v for k, v in headers if k == b"authorization"), None)
            if given != self.expected:
                await error_response(401, "Invalid or missing API key.")(scope, receive, tagged)
                return
        await self.app(scope, receive, tagged)
