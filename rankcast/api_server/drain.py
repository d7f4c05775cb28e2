"""How an API server stops: refuse new work at once, let what is in flight finish, end the rest.

On the first SIGTERM or SIGINT the server starts draining: every new request (and `/health`, so a
load balancer stops sending) gets a 503 with `Retry-After` while the listening socket stays open
(a refused connection would tell a client nothing). Requests already running may finish for up to
`--shutdown-timeout` seconds; then the ones left are ended: a stream gets a last chunk with a
finish reason, an error event naming the shutdown and `[DONE]`; a plain request gets a 503. Only
then does uvicorn stop. A second Ctrl-C stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from rankcast.api_server.errors import error_response

logger = logging.getLogger(__name__)

# Paths a draining server still answers: scrapers should see the last figures.
STILL_SERVED = ("/metrics",)
# Long-lived streams that do not hold a drain open (they are closed when it starts).
NOT_IN_FLIGHT = ("/v1/events",)
RETRY_AFTER_S = 5


class ServerShuttingDownError(RuntimeError):
    """The API server is stopping and the request ran out of time to finish."""


class Drain:
    """The drain's state, shared by the gate (the middleware) and the server."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.requested = False  # set from a signal handler: only a flag
        self.draining = False
        self.in_flight = 0

    async def run(
        self, end_the_rest: Callable[[], None], close_streams: Callable[[], None]
    ) -> None:
        """From the signal on: wait for the in-flight requests, up to the timeout, then end
        the rest and wait (briefly) for their answers to leave."""
        self.draining = True
        close_streams()
        logger.info(
            "stopping: %d request(s) in flight get up to %.0f s to finish",
            self.in_flight,
            self.timeout_s,
        )
        deadline = time.monotonic() + self.timeout_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.in_flight:
            logger.warning("ending %d request(s) still in flight", self.in_flight)
            end_the_rest()
            cut = time.monotonic() + 5
            while self.in_flight and time.monotonic() < cut:
                await asyncio.sleep(0.05)


class DrainGate:
    """ASGI middleware: counts requests in flight, and answers 503 + Retry-After to new ones
    once the drain has started."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if self.drain.draining and not path.startswith(STILL_SERVED):
            response = error_response(503, "The server is shutting down; retry elsewhere.")
            response.headers["retry-after"] = str(RETRY_AFTER_S)
            await response(scope, receive, send)
            return
        counted = not path.startswith(NOT_IN_FLIGHT)
        if counted:
            self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            if counted:
                self.drain.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first stop signal starts a drain instead of a shutdown."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain.requested:
            # Ctrl-C again: stop now. A SIGTERM during the drain is the launcher passing on
            # the same stop (Ctrl-C reached the whole group): the drain goes on.
            if sig == signal.SIGINT:
                super().handle_exit(sig, frame)
            return
        self.drain.requested = True
