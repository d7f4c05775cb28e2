"""Clients of an engine core in another process, over one ZMQ socket pair per frontend.

Both clients say hello with the protocol version, wait for `EngineReady`, and watch the engine
process so that its death is noticed at once (the output socket disconnects, or the pid exits),
never discovered by a request hanging forever. The API server's client says its hello again,
on fresh sockets, until it is answered: an engine core that dies while the server starts (or
reconnects) takes the hello with it, and only its next incarnation can answer.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from rankcast.addresses import ClientAddresses
from rankcast.engine_client.core_client import AsyncEngineCoreClient, EngineCoreClient
from rankcast.process import process_is_alive
from rankcast.protocol import (
    PROTOCOL_VERSION,
    AbortRequests,
    ClientHello,
    EngineCoreMessage,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    ErrorKind,
    R,
    Utility,
    UtilityOutput,
    UtilityRequest,
)
from rankcast.start_up_holds import hold_here

logger = logging.getLogger(__name__)

# How long one hello waits for its answer before it is said again on fresh sockets. A live
# engine core answers between two steps (well under this); a dead one never does.
HELLO_ATTEMPT_S = 2.0


class EngineDeadError(RuntimeError):
    """The engine core process is gone; nothing sent to it will be answered."""


class ProtocolMismatchError(RuntimeError):
    """The engine core and this frontend speak different wire protocol versions."""


class UtilityError(RuntimeError):
    """A utility call reached the engine core and failed there; `kind` says whose fault
    (`ErrorKind`: a client's, or `internal`), for the caller to choose its answer by."""

    def __init__(self, message: str, kind: str = "") -> None:
        super().__init__(message)
        known = {k.value for k in ErrorKind}
        self.kind = ErrorKind(kind) if kind in known else ErrorKind.INTERNAL


def _check_ready(ready: EngineReady) -> EngineReady:
    if ready.error:
        raise ProtocolMismatchError(ready.error)
    if ready.protocol_version != PROTOCOL_VERSION:
        raise ProtocolMismatchError(
            f"protocol version mismatch: engine core speaks {ready.protocol_version}, "
            f"this API server speaks {PROTOCOL_VERSION}"
        )
    return ready


class SyncMPClient(EngineCoreClient):
    """Blocking client, for tools and tests that drive a separate engine core process."""

    def __init__(
        self, addresses: ClientAddresses, client_index: int = 0, timeout_s: float = 600.0
    ) -> None:
        self.context = zmq.Context()
        self.input = self.context.socket(zmq.PUSH)
        self.input.setsockopt(zmq.LINGER, 0)
        self.input.connect(addresses.input)
        self.output = self.context.socket(zmq.PULL)
        self.output.connect(addresses.output)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(EngineCoreMessage)
        self.pending: collections.deque[EngineCoreOutputs] = collections.deque()
        self.call_ids = itertools.count()
        self.input.send(self.encoder.encode(ClientHello(PROTOCOL_VERSION, client_index)))
        self.ready = _check_ready(self._receive_ready(timeout_s))
        self.max_model_len = self.ready.max_model_len

    def _receive_ready(self, timeout_s: float) -> EngineReady:
        if not self.output.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"engine core did not answer the handshake in {timeout_s:.0f} s")
        message = self.decoder.decode(self.output.recv())
        if not isinstance(message, EngineReady):
            raise ProtocolMismatchError(f"expected EngineReady, got {type(message).__name__}")
        return message

    def _receive(self, timeout_s: float | None) -> EngineCoreOutputs:
        deadline_ms = None if timeout_s is None else int(timeout_s * 1000)
        waited = 0
        while True:
            if self.output.poll(250):
                message = self.decoder.decode(self.output.recv())
                if isinstance(message, EngineCoreOutputs):
                    return message
                continue
            waited += 250
            if not process_is_alive(self.ready.pid):
                raise EngineDeadError(f"engine core (pid {self.ready.pid}) has exited")
            if deadline_ms is not None and waited >= deadline_ms:
                raise TimeoutError("no output from the engine core in time")

    def add_request(self, request: EngineCoreRequest) -> None:
        self.input.send(self.encoder.encode(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.input.send(self.encoder.encode(AbortRequests(request_ids)))

    def get_output(self, timeout_s: float | None = None) -> EngineCoreOutputs:
        if self.pending:
            return self.pending.popleft()
        return self._receive(timeout_s)

    def call(self, utility: Utility[R], timeout_s: float = 60.0) -> R:
        return utility.reply(
            self.call_utility(utility.METHOD, *utility.wire_args(), timeout_s=timeout_s)
        )

    def call_utility(self, method: str, *args: Any, timeout_s: float = 60.0) -> Any:
        """The call as the wire carries it: a name and positional arguments (`call` is the
        typed way; this one can also send what no struct declares, as a test of refusal)."""
        call_id = next(self.call_ids)
        self.input.send(self.encoder.encode(UtilityRequest(call_id, method, list(args))))
        while True:
            message = self._receive(timeout_s)
            reply = message.utility_output
            if reply is not None and reply.call_id == call_id:
                if reply.error:
                    raise UtilityError(reply.error, reply.error_kind)
                return reply.result
            if (
                message.outputs
                or message.scheduler_stats is not None
                or message.engine_notifications
            ):
                self.pending.append(message)

    def shutdown(self) -> None:
        self.context.destroy(linger=0)


class AsyncMPClient(AsyncEngineCoreClient):
    """The asyncio client an API server uses; one reader task feeds outputs to a queue."""

    def __init__(self, addresses: ClientAddresses, client_index: int) -> None:
        self.addresses = addresses
        self.client_index = client_index
        self.context = zmq.asyncio.Context()
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(EngineCoreMessage)
        self.queue: asyncio.Queue[EngineCoreOutputs | UtilityOutput | Exception] = asyncio.Queue()
        self.call_ids = itertools.count()
        self.calls: dict[int, asyncio.Future[Any]] = {}
        self.tasks: list[asyncio.Task[None]] = []
        self.dead: EngineDeadError | None = None
        self.ready: EngineReady | None = None
        self.monitor: zmq.asyncio.Socket | None = None

    async def start(self, timeout_s: float | None = None) -> None:
        """Connect to the engine core; with `timeout_s`, fails with TimeoutError when no
        incarnation of it has answered by then. An API server starts beside a loading engine
        core and waits as long as the launcher lets it (`rankcast/launcher/fleet.py` times
        its start from when every engine core is up)."""
        await self._connect_until_answered(timeout_s)

    async def _connect_until_answered(self, timeout_s: float | None) -> None:
        """Say hello, on fresh sockets each time, every `HELLO_ATTEMPT_S` until the engine core
        answers (or `timeout_s` passes: TimeoutError). A hello the engine took with it as it
        died is never answered; the next incarnation binds the same addresses and hears the
        next one. A refusal (another protocol version) is final."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while True:
            left = None if deadline is None else deadline - loop.time()
            try:
                await self._connect(HELLO_ATTEMPT_S if left is None else min(HELLO_ATTEMPT_S, left))
            except TimeoutError:
                if deadline is not None and loop.time() >= deadline:
                    raise TimeoutError(
                        f"engine core did not answer the handshake in {timeout_s:.0f} s"
                    ) from None
                continue
            return

    async def _connect(self, timeout_s: float) -> None:
        """Fresh sockets, the hello, the engine's `EngineReady`, then the reader and the
        watchers; a handshake that times out leaves the sockets closed."""
        self.input = self.context.socket(zmq.PUSH)
        self.input.setsockopt(zmq.LINGER, 0)
        self.input.connect(self.addresses.input)
        self.output = self.context.socket(zmq.PULL)
        self.output.setsockopt(zmq.LINGER, 0)
        monitor = self.output.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.output.connect(self.addresses.output)
        try:
            await self.input.send(
                self.encoder.encode(ClientHello(PROTOCOL_VERSION, self.client_index))
            )
            hold_here("hello")  # a fault test's moment: the hello sent, its answer not read
            self.ready = _check_ready(await self._receive_ready(timeout_s))
        except BaseException:
            self._close_sockets(monitor)
            raise
        self.max_model_len = self.ready.max_model_len
        self.dead = None
        self.tasks = [
            asyncio.create_task(self._read_outputs()),
            asyncio.create_task(self._watch_disconnect(monitor)),
            asyncio.create_task(self._watch_pid()),
        ]
        self.monitor = monitor

    def _close_sockets(self, monitor: zmq.asyncio.Socket | None) -> None:
        if monitor is not None:
            self.output.disable_monitor()
            monitor.close(linger=0)
        self.input.close(linger=0)
        self.output.close(linger=0)

    async def reconnect(self) -> None:
        """After the engine core died: say hello until its next incarnation (started by the
        launcher's supervisor, on the same addresses) answers, then serve from it. Tries until
        it succeeds or the task is cancelled; the caller fails the dead engine's requests
        first, so nothing waits on this."""
        for task in self.tasks:
            task.cancel()
        self.tasks = []
        self._close_sockets(self.monitor)
        self.queue = asyncio.Queue()
        await self._connect_until_answered(None)

    async def _receive_ready(self, timeout_s: float) -> EngineReady:
        """The handshake reply. A restarted API server may first receive what the engine sent
        its predecessor; that belongs to no stream here and is skipped."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0 or not await self.output.poll(int(remaining * 1000)):
                raise TimeoutError(f"engine core did not answer the handshake in {timeout_s:.0f} s")
            frame = await self.output.recv()
            try:
                message = self.decoder.decode(frame)
            except msgspec.ValidationError as exc:
                raise ProtocolMismatchError(f"cannot read the engine core's reply: {exc}") from None
            if isinstance(message, EngineReady):
                return message

    def _mark_dead(self, why: str) -> None:
        if self.dead is not None:
            return
        self.dead = EngineDeadError(why)
        logger.error("engine core is dead: %s", why)
        self.queue.put_nowait(self.dead)
        for future in self.calls.values():
            if not future.done():
                future.set_exception(self.dead)

    async def _read_outputs(self) -> None:
        while self.dead is None:
            frame = await self.output.recv()
            message = self.decoder.decode(frame)
            if not isinstance(message, EngineCoreOutputs):
                continue
            reply = message.utility_output
            if reply is not None:
                # Answered in stream order: the events the utility caused were sent before its
                # reply, and the caller must see them applied when its await returns.
                self.queue.put_nowait(reply)
                continue
            self.queue.put_nowait(message)

    async def _watch_disconnect(self, monitor: zmq.asyncio.Socket) -> None:
        while self.dead is None:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._mark_dead("the engine core closed its connection")

    async def _watch_pid(self) -> None:
        assert self.ready is not None
        while self.dead is None:
            if not process_is_alive(self.ready.pid):
                self._mark_dead(f"engine core process {self.ready.pid} exited")
            await asyncio.sleep(0.5)

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise self.dead

    async def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        await self.input.send(self.encoder.encode(request))

    async def abort_requests(self, request_ids: list[str]) -> None:
        if self.dead is None and request_ids:
            await self.input.send(self.encoder.encode(AbortRequests(request_ids)))

    async def get_output(self) -> EngineCoreOutputs:
        while True:
            item = await self.queue.get()
            if isinstance(item, Exception):
                self.queue.put_nowait(item)  # every later reader learns it too
                raise item
            if isinstance(item, UtilityOutput):
                self._answer(item)
                continue
            return item

    def _answer(self, reply: UtilityOutput) -> None:
        future = self.calls.pop(reply.call_id, None)
        if future is None or future.done():
            return
        if reply.error:
            future.set_exception(UtilityError(reply.error, reply.error_kind))
        else:
            future.set_result(reply.result)

    async def call(self, utility: Utility[R], timeout_s: float = 60.0) -> R:
        result = await self.call_utility(utility.METHOD, *utility.wire_args(), timeout_s=timeout_s)
        return utility.reply(result)

    async def call_utility(self, method: str, *args: Any, timeout_s: float = 60.0) -> Any:
        """The call as the wire carries it: a name and positional arguments."""
        self._check_alive()
        call_id = next(self.call_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.calls[call_id] = future
        await self.input.send(self.encoder.encode(UtilityRequest(call_id, method, list(args))))
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self.calls.pop(call_id, None)

    def shutdown(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.context.destroy(linger=0)
