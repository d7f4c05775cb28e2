"""The engine core as its own process: ZMQ I/O threads around the busy loop.

    input thread  : polls every API server's input socket, decodes, queues (client, message)
    busy loop     : hands each message to `EngineCore.handle`, then steps the core (or asks it
                    for its idle outputs) and queues what the core says to send, per client
    output thread : encodes and sends each message on its API server's output socket

This module decides nothing about the channel or routing: who gets which output, when
notifications are gathered and flushed, is `EngineCore`'s (rankcast/engine_core/core.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import socket
import threading
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

from rankcast.addresses import EngineAddresses
from rankcast.channel.stream import NotificationPublisher
from rankcast.channel.vllm_kv_events import KVEventPublisher
from rankcast.config import EngineConfig
from rankcast.engine_core.core import EngineCore, Outbox
from rankcast.executor.base import ExecutorError, RankLostError
from rankcast.logger import init_logging
from rankcast.model_files.source import ModelSource
from rankcast.process import (
    die_with_parent,
    end_signal_wakeup,
    set_process_title,
    signal_wakeup,
)
from rankcast.protocol import (
    EngineCoreInput,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineReady,
    FinishReason,
)
from rankcast.start_up_holds import hold_here
from rankcast.startup_gc import collector_paused, freeze_startup_heap

logger = logging.getLogger(__name__)

# How long the handshake reply waits for the client's output connection to come up.
_HANDSHAKE_WAIT_MS = 10_000
# Outputs queued for one API server before further ones are dropped (a dead or stuck peer).
_SEND_HWM = 100_000
# Put on the input queue to end an idle wait; carries nothing for the engine.
_WAKE = object()


class EngineCoreProc:
    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        addresses: EngineAddresses,
        engine_index: int = 0,
        incarnation: int = 0,
    ) -> None:
        # The cores this process may use, taken before an in-process rank binds this (its main)
        # thread to its own: the I/O threads run anywhere in the set, not on the rank's core.
        self.io_cpus = os.sched_getaffinity(0)
        # vLLM-format KV events bind before the model loads: a router's subscriber reconnects
        # to a restarted engine while it loads, and so hears the new incarnation's first event
        # (the cache is empty) instead of missing it.
        self.kv_publisher = KVEventPublisher.create(config.cache.kv_events_config, engine_index)
        try:
            self.core = EngineCore(config, source, engine_index, incarnation)
        except BaseException:
            if self.kv_publisher is not None:
                self.kv_publisher.close()
            raise
        if self.kv_publisher is not None:
            self.core.kv_event_sinks.append(self.kv_publisher.publish_events)
        self.engine_index = engine_index
        self.addresses = addresses
        self.inputs: queue.Queue[tuple[int, Any]] = queue.Queue()
        self.outputs: queue.Queue[tuple[int, Any] | None] = queue.Queue()
        self.stopping = threading.Event()
        # Readable when SIGTERM arrives (`signal.set_wakeup_fd`, set by `run_engine_core`): the
        # input thread polls it beside the sockets, so a stop is seen at once, not at the
        # poll's next timeout (up to 0.2 s later, on every stop and restart).
        self.signalled: socket.socket | None = None
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
        self.core.on_rank_failure(self._on_executor_failure)
        self.publisher = NotificationPublisher.create(config.notifications, engine_index)
        if self.publisher is not None:
            publisher = self.publisher
            self.core.flush_sinks.append(
                lambda raws: publisher.publish_batch(raws, self.core.snapshot)
            )
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
        # A plain socket comes back from the poll as its file descriptor, not as itself.
        signalled_fd = None if self.signalled is None else self.signalled.fileno()
        if signalled_fd is not None:
            poller.register(signalled_fd, zmq.POLLIN)
        while not self.stopping.is_set():
            for sock, _ in poller.poll(timeout=200):
                if sock == signalled_fd and self.signalled is not None:
                    # The byte is the signal's number: a SIGTERM is the stop the handler will
                    # also ask for, taken here at once (the handler runs later, between
                    # bytecodes of the main thread).
                    with contextlib.suppress(BlockingIOError):
                        if signal.SIGTERM in self.signalled.recv(64):
                            self.stopping.set()
                    continue
                frame = sock.recv(copy=False)
                try:
                    message = decoder.decode(frame.buffer)
                except msgspec.DecodeError as exc:
                    self._refuse_undecodable(index_of[sock], frame.buffer, exc)
                    continue
                self.inputs.put((index_of[sock], message))
        # Told to stop (SIGTERM sets `stopping` from a signal handler, which must not touch the
        # queue's lock itself): wake an idle busy loop now rather than at its next idle timeout.
        self.inputs.put((-1, _WAKE))

    def _refuse_undecodable(self, client: int, frame: Any, exc: msgspec.DecodeError) -> None:
        """A request the engine cannot decode is answered with why, not dropped: its client
        would wait for it forever. A client that cannot check a request fully itself (the Rust
        API server cannot build a JSON schema's grammar; the schema's check runs here, when
        the request is decoded) hears it this way."""
        logger.error("undecodable message from client %d: %s", client, exc)
        try:
            raw = msgspec.msgpack.decode(frame)
        except msgspec.DecodeError:
            return
        if isinstance(raw, list) and len(raw) > 1 and raw[0] == "add" and isinstance(raw[1], str):
            refused = EngineCoreOutput(raw[1], [], finish_reason=FinishReason.ABORT, error=str(exc))
            self.outputs.put((client, EngineCoreOutputs(self.engine_index, outputs=[refused])))

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

    def _send_all(self, outbox: Outbox | dict[int, EngineCoreOutputs] | None) -> None:
        if not outbox:
            return
        for client, message in outbox.items() if isinstance(outbox, dict) else outbox:
            self.outputs.put((client, message))

    def _drain_inputs(self, block: bool) -> None:
        try:
            client, message = (
                self.inputs.get(timeout=self.core.idle_timeout())
                if block
                else self.inputs.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            if isinstance(message, ExecutorError):
                raise message
            if message is not _WAKE:
                self._send_all(self.core.handle(client, message))
            try:
                client, message = self.inputs.get_nowait()
            except queue.Empty:
                return

    def run(self, last_words: Connection | None = None) -> None:
        """Serve until told to stop; any failure (a dead rank, say) ends the process loudly, so
        every API server notices at once and answers 503 instead of waiting forever. Why it
        failed goes to `last_words` (the launcher's readiness pipe, still open), so the
        supervisor can say which rank was lost (`/health`)."""
        for thread in self.threads:
            thread.start()
        if self.publisher is not None:
            self.publisher.start_with(self.core.snapshot)
        if self.kv_publisher is not None:
            self.kv_publisher.start()
        try:
            self.core.start()
            while not self.stopping.is_set():
                busy = self.core.has_unfinished_requests() and not self.core.stalled
                self._drain_inputs(block=not busy)
                if self.core.has_unfinished_requests():
                    self._send_all(self.core.step())
                else:
                    self._send_all(self.core.idle_outputs())
        except Exception as exc:
            logger.exception("engine core failed; exiting")
            if last_words is not None:
                with contextlib.suppress(OSError):
                    last_words.send(("failed", str(exc).split("\n", 1)[0]))
            self.close()
            raise SystemExit(1) from None
        self.close()

    def close(self) -> None:
        self.stopping.set()
        self.outputs.put(None)
        for publisher in (self.publisher, self.kv_publisher):
            if publisher is not None:
                publisher.close()
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
    incarnation: int,
    ready: Connection,
) -> None:
    """Process entry point: build the engine, report readiness (or the error), serve until told.
    `incarnation` is how many times the launcher has started this engine core before."""
    role = f"engine_core_dp{engine_index}"
    set_process_title(role)
    init_logging(role)
    die_with_parent()
    if incarnation:
        logger.info("starting again (incarnation %d)", incarnation)
    hold_here("load")  # a fault test's moment: nothing loaded yet
    try:
        with collector_paused():  # what it builds lives as long as the process
            proc = EngineCoreProc(config, source, addresses, engine_index, incarnation)
    except Exception as exc:
        logger.exception("engine core failed to start")
        # A lost rank is a death the launcher restarts from; any other failure is this
        # configuration's own, and would only repeat (rankcast/launcher/fleet.py).
        kind = "lost" if isinstance(exc, RankLostError) else "error"
        ready.send((kind, f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None

    def stop(signum: int, _frame: object) -> None:
        proc.stopping.set()

    signal.signal(signal.SIGTERM, stop)
    wakeup = signal_wakeup()
    proc.signalled = wakeup[0]
    # Ctrl-C reaches the whole process group: the launcher stops the engine (SIGTERM) once the
    # API servers have drained the requests that still need it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    freeze_startup_heap()
    ready.send(("ready", proc.core.max_model_len))
    hold_here("serve")  # a fault test's moment: ready, but no hello answered yet
    try:
        proc.run(last_words=ready)
    finally:
        end_signal_wakeup(wakeup)
