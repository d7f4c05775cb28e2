"""The engine core as its own process: ZMQ I/O threads around the busy loop.

    input thread  : polls every API server's input socket, decodes, queues (client, message)
    busy loop     : admits requests, runs utility calls, steps the core, routes outputs
    output thread : encodes and sends each message on its API server's output socket

Request outputs go only to the API server that sent the request; scheduler stats and engine
notifications go to all of them, in the same order, so every frontend reports the same
engine-wide figures. A notification never waits for traffic: when no step runs, it leaves in a
notification-only message.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

from rankcast.config import EngineConfig
from rankcast.engine.addresses import EngineAddresses
from rankcast.engine.core import EngineCore
from rankcast.engine.notification_channel import GatherError
from rankcast.engine.notification_publisher import NotificationPublisher
from rankcast.executor.base import ExecutorError
from rankcast.logger import init_logging
from rankcast.model.source import ModelSource
from rankcast.process import die_with_parent, set_process_title
from rankcast.protocol import (
    PROTOCOL_VERSION,
    AbortRequests,
    ClientHello,
    EngineCoreInput,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    FinishReason,
    SchedulerStats,
    UtilityOutput,
    UtilityRequest,
)

logger = logging.getLogger(__name__)

# How long an idle busy loop waits for input before looking around again.
_IDLE_WAIT_S = 1.0
# How long the handshake reply waits for the client's output connection to come up.
_HANDSHAKE_WAIT_MS = 10_000
# Outputs queued for one API server before further ones are dropped (a dead or stuck peer).
_SEND_HWM = 100_000


class EngineCoreProc:
    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        addresses: EngineAddresses,
        engine_index: int = 0,
    ) -> None:
        # The cores this process may use, taken before an in-process rank binds this (its main)
        # thread to its own: the I/O threads run anywhere in the set, not on the rank's core.
        self.io_cpus = os.sched_getaffinity(0)
        self.core = EngineCore(config, source, engine_index)
        self.engine_index = engine_index
        self.addresses = addresses
        self.inputs: queue.Queue[tuple[int, Any]] = queue.Queue()
        self.outputs: queue.Queue[tuple[int, Any] | None] = queue.Queue()
        self.connected: set[int] = set()
        self.owners: dict[str, int] = {}
        self.last_stats: SchedulerStats | None = None
        self.stopping = threading.Event()
        self.context = zmq.Context()
        # Bind before the threads start so an early client's messages are not lost.
        self.input_sockets = []
        self.output_sockets = []
        for client in addresses.clients:
            pull = self.context.socket(zmq.PULL)
            pull.bind(client.input)
            push = self.context.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, _SEND_HWM)
            push.setsockopt(zmq.LINGER, 0)
            push.bind(client.output)
            self.input_sockets.append(pull)
            self.output_sockets.append(push)
        self.core.executor.failure_callback = self._on_executor_failure
        self.publisher = NotificationPublisher.create(config.notifications, engine_index)
        self.threads = [
            threading.Thread(target=self._input_thread, name="engine-input", daemon=True),
            threading.Thread(target=self._output_thread, name="engine-output", daemon=True),
        ]

    # ---- I/O threads ----

    def _input_thread(self) -> None:
        os.sched_setaffinity(0, self.io_cpus)
        decoder = msgspec.msgpack.Decoder(EngineCoreInput)
        poller = zmq.Poller()
        for sock in self.input_sockets:
            poller.register(sock, zmq.POLLIN)
        index_of = {sock: i for i, sock in enumerate(self.input_sockets)}
        while not self.stopping.is_set():
            for sock, _ in poller.poll(timeout=200):
                frame = sock.recv(copy=False)
                try:
                    message = decoder.decode(frame.buffer)
                except msgspec.DecodeError as exc:
                    logger.error(
                        "dropping undecodable message from client %d: %s", index_of[sock], exc
                    )
                    continue
                self.inputs.put((index_of[sock], message))

    def _output_thread(self) -> None:
        os.sched_setaffinity(0, self.io_cpus)
        encoder = msgspec.msgpack.Encoder()
        dropped = 0
        while True:
            item = self.outputs.get()
            if item is None:
                return
            client, message = item
            sock = self.output_sockets[client]
            if isinstance(message, EngineReady):
                # The hello can arrive before the client's output connection is up; a PUSH
                # socket with no peer refuses the send, so wait for it (this only stalls here).
                sock.poll(_HANDSHAKE_WAIT_MS, zmq.POLLOUT)
            try:
                sock.send(encoder.encode(message), flags=zmq.NOBLOCK)
            except zmq.Again:
                dropped += 1
                if dropped == 1 or dropped % 1000 == 0:
                    logger.warning(
                        "API server %d is not reading; %d messages dropped", client, dropped
                    )

    def _on_executor_failure(self, why: str) -> None:
        """Wake the busy loop with the failure, even when it is idle waiting for input."""
        self.inputs.put((-1, ExecutorError(why)))

    # ---- busy loop ----

    def _handle(self, client: int, message: Any) -> None:
        if isinstance(message, ExecutorError):
            raise message
        if isinstance(message, EngineCoreRequest):
            if client not in self.connected:
                return
            try:
                self.core.add_request(message)
                self.owners[message.request_id] = client
            except ValueError as exc:
                # The frontend validates first; if it did not, finish the request with an error.
                logger.warning("rejected request %s: %s", message.request_id, exc)
                self._send(
                    client,
                    EngineCoreOutputs(
                        self.engine_index,
                        outputs=[
                            EngineCoreOutput(
                                message.request_id,
                                [],
                                finish_reason=FinishReason.ABORT,
                                error=str(exc),
                            )
                        ],
                    ),
                )
        elif isinstance(message, AbortRequests):
            self.core.abort_requests(message.request_ids)
            for request_id in message.request_ids:
                self.owners.pop(request_id, None)
        elif isinstance(message, UtilityRequest):
            reply = self._run_utility(message)
            # Events the utility caused reach every API server before the caller hears back.
            self._broadcast(None)
            self._send(client, EngineCoreOutputs(self.engine_index, utility_output=reply))
        elif isinstance(message, ClientHello):
            self._hello(client, message)

    def _hello(self, client: int, hello: ClientHello) -> None:
        error = ""
        if hello.protocol_version != PROTOCOL_VERSION:
            error = (
                f"protocol version mismatch: engine core speaks {PROTOCOL_VERSION}, "
                f"API server {client} speaks {hello.protocol_version}; run the same rankcast "
                "version on both"
            )
            logger.error(error)
        else:
            self._forget_client_requests(client)
            self.connected.add(client)
        blocks = self.core.scheduler.blocks
        self._send(
            client,
            EngineReady(
                PROTOCOL_VERSION,
                self.engine_index,
                self.core.max_model_len,
                blocks.num_blocks,
                blocks.block_size,
                pid=os.getpid(),
                error=error,
                # Taken on this thread between flushes: the stream that follows starts exactly
                # where the snapshot ends.
                snapshot=None if error else self.core.snapshot(),
            ),
        )
        if not error:
            self._send(
                client,
                EngineCoreOutputs(
                    self.engine_index,
                    scheduler_stats=self.core.stats(),
                    timestamp=time.time(),
                ),
            )

    def _forget_client_requests(self, client: int) -> None:
        """A (re)connecting API server has no stream for requests it sent before: abort them."""
        orphans = [rid for rid, owner in self.owners.items() if owner == client]
        if orphans:
            logger.warning(
                "API server %d reconnected; aborting its %d old requests", client, len(orphans)
            )
            self.core.abort_requests(orphans)
            for request_id in orphans:
                del self.owners[request_id]

    def _run_utility(self, request: UtilityRequest) -> UtilityOutput:
        try:
            return UtilityOutput(
                request.call_id, result=self.core.call_utility(request.method, *request.args)
            )
        except GatherError:
            raise  # a rank failed under the channel: the engine stops, loudly
        except ValueError as exc:
            return UtilityOutput(request.call_id, error=str(exc))
        except Exception as exc:
            logger.exception("utility %s failed", request.method)
            return UtilityOutput(request.call_id, error=f"{type(exc).__name__}: {exc}")

    def _send(self, client: int, message: Any) -> None:
        self.outputs.put((client, message))

    def _route(self, step: EngineCoreOutputs) -> None:
        """Each API server gets its own requests' outputs; every one gets the stats and the
        same notification batch (encoded once)."""
        per_client: dict[int, list[EngineCoreOutput]] = {}
        for output in step.outputs:
            owner = self.owners.get(output.request_id)
            if owner is None:
                continue
            per_client.setdefault(owner, []).append(output)
            if output.finished:
                del self.owners[output.request_id]
        self._publish(step.engine_notifications)
        for client in self.connected:
            mine = per_client.get(client, [])
            self._send(
                client,
                EngineCoreOutputs(
                    self.engine_index,
                    outputs=mine,
                    scheduler_stats=step.scheduler_stats,
                    timestamp=step.timestamp,
                    finished_requests=[o.request_id for o in mine if o.finished] or None,
                    engine_notifications=step.engine_notifications,
                ),
            )
        self.last_stats = step.scheduler_stats

    def _broadcast(self, stats: SchedulerStats | None) -> None:
        """Send pending notifications (and `stats`, if given) to every API server, if any."""
        notifications = self.core.notifications.flush()
        if notifications is None and stats is None:
            return
        self._publish(notifications)
        for client in self.connected:
            self._send(
                client,
                EngineCoreOutputs(
                    self.engine_index,
                    scheduler_stats=stats,
                    timestamp=time.time(),
                    engine_notifications=notifications,
                ),
            )

    def _publish(self, notifications: list[msgspec.Raw] | None) -> None:
        if notifications and self.publisher is not None:
            self.publisher.publish(notifications, self.core.snapshot)

    def _idle_tick(self) -> None:
        """No step ran: look at the doorbell (and poll), then send what changed."""
        self.core.notifications.collect()
        stats = self.core.stats()
        changed = stats != self.last_stats
        self.last_stats = stats
        self._broadcast(stats if changed else None)

    def _drain_inputs(self, block: bool) -> None:
        try:
            client, message = (
                self.inputs.get(timeout=self.core.notifications.idle_wait(_IDLE_WAIT_S))
                if block
                else self.inputs.get_nowait()
            )
        except queue.Empty:
            return
        self._handle(client, message)
        while True:
            try:
                client, message = self.inputs.get_nowait()
            except queue.Empty:
                return
            self._handle(client, message)

    def run(self) -> None:
        """Serve until told to stop; any failure (a dead rank, say) ends the process loudly, so
        every API server notices at once and answers 503 instead of waiting forever."""
        for thread in self.threads:
            thread.start()
        if self.publisher is not None:
            self.publisher.start(self.core.snapshot)
        try:
            # Load-time events (each rank's weight-load figure) were published before any
            # client could ask: gather them once, they leave with the first message.
            self.core.gather_worker_notifications()
            while not self.stopping.is_set():
                self._drain_inputs(block=not self.core.has_unfinished_requests())
                if self.core.has_unfinished_requests():
                    self._route(self.core.step())
                else:
                    self._idle_tick()
        except Exception:
            logger.exception("engine core failed; exiting")
            self.close()
            raise SystemExit(1) from None
        self.close()

    def close(self) -> None:
        self.stopping.set()
        self.outputs.put(None)
        if self.publisher is not None:
            self.publisher.close()
        for thread in self.threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(timeout=2)
        self.core.shutdown()
        self.context.destroy(linger=0)


def run_engine_core(
    config: EngineConfig,
    source: ModelSource,
    addresses: EngineAddresses,
    engine_index: int,
    ready: Connection,
) -> None:
    """Process entry point: build the engine, report readiness (or the error), serve until told."""
    role = f"engine_core_dp{engine_index}"
    set_process_title(role)
    init_logging(role)
    die_with_parent()
    try:
        proc = EngineCoreProc(config, source, addresses, engine_index)
    except Exception as exc:
        logger.exception("engine core failed to start")
        ready.send(("error", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None

    def stop(signum: int, _frame: object) -> None:
        proc.stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    ready.send(("ready", proc.core.max_model_len))
    ready.close()
    proc.run()
