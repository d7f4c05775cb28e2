"""A sequenced ZMQ publisher with replay: the socket layer both event streams share.

Frames are `[topic, 8-byte big-endian seq, payload]` on a PUB socket, seq counting from 0 in
each publisher process (a subscriber that sees it go back knows the engine restarted). With a
replay endpoint a ROUTER socket answers `[b"", start_seq]` (8 bytes, big-endian) with every
batch still held from that seq, each as `[b"", topic, seq, payload]`, then the end marker
`[b"", b"", seq -1, b""]`: vLLM's publisher's framing, which KV-aware routers already consume.
A subclass may answer other requests on the same socket (`answer_request`).

Sockets live on their own thread, so the engine's busy loop only hands over bytes. The first
batches wait (at most `hold_s` from the bind) for a subscriber to join, so one that reconnects
to a restarted engine hears its sequence from 0.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import overload
from urllib.parse import urlsplit

import zmq

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


@overload
def endpoint_for_engine(endpoint: str, engine_index: int) -> str: ...
@overload
def endpoint_for_engine(endpoint: None, engine_index: int) -> None: ...
def endpoint_for_engine(endpoint: str | None, engine_index: int) -> str | None:
    """Each data-parallel engine core gets its own endpoint: tcp ports count up (port 0, any
    free port, stays 0), other transports get a suffix; engine 0 keeps the endpoint as given
    (None, no endpoint, stays None)."""
    if endpoint is None or engine_index == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        parts = urlsplit(endpoint)
        host, _, port = parts.netloc.rpartition(":")
        if int(port) == 0:
            return endpoint
        return f"tcp://{host}:{int(port) + engine_index}"
    return f"{endpoint}_dp{engine_index}"


class SequencedPublisher:
    """Binds at construction (a bad endpoint fails the engine's start with its name), publishes
    from `start()` on. `publish` and `set_state` only queue: the thread does the sending."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        topic: bytes,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        name: str = "publisher",
        hold_s: float = 2.0,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.buffer_steps = buffer_steps
        # (payload, state after it); a payload of None carries only a state.
        self.queue: queue.Queue[tuple[bytes | None, bytes | None] | None] = queue.Queue()
        self.context = zmq.Context()
        # XPUB: a PUB that hears subscriptions, so the first batches can wait for one.
        self.pub = self.context.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, hwm)
        self.pub.bind(endpoint)
        self.hold_until = time.monotonic() + hold_s
        self.joined = False
        self.router: zmq.Socket[bytes] | None = None
        if replay_endpoint:
            self.router = self.context.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(replay_endpoint)
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        # The seq of the last payload sent, and the latest state (the thread's own).
        self.seq = -1
        self.state = b""

    def start(self) -> None:
        self.thread.start()

    def publish(self, payload: bytes, state: bytes | None = None) -> None:
        """Queue one batch (and, optionally, the state as of just after it)."""
        self.queue.put((payload, state))

    def set_state(self, state: bytes) -> None:
        self.queue.put((None, state))

    def _run(self) -> None:
        held: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=self.buffer_steps)
        # Items held back by the first-batch hold, in order: a state waits with the batches
        # before it, so a snapshot never includes a batch whose seq it does not name.
        pending: collections.deque[tuple[bytes | None, bytes | None]] = collections.deque()
        while True:
            waiting = bool(pending) or self.router is not None
            try:
                item = self.queue.get(timeout=0.01 if waiting else None)
            except queue.Empty:
                item = (None, None)  # nothing new: only look at the sockets
            if item is None:
                return
            if item[0] is not None or pending:
                pending.append(item)
            elif item[1] is not None:
                self.state = item[1]
            if pending and self._may_send():
                while pending:
                    payload, state = pending.popleft()
                    if payload is not None:
                        self.seq += 1
                        frames = [self.topic, self.seq.to_bytes(8, "big"), payload]
                        self.pub.send_multipart(frames)
                        held.append((self.seq, payload))
                    if state is not None:
                        self.state = state
            while self.router is not None and self.router.poll(0):
                self._answer(held)

    def _may_send(self) -> bool:
        """Whether the first batches may leave: once a subscriber joined, or `hold_s` after the
        bind. A subscriber of the previous incarnation reconnects within ZMQ's reconnect
        interval (100 ms by default); without the hold, a fast start publishes seq 0 (the
        incarnation's `AllBlocksCleared`) before it is back, and it never hears it."""
        if self.joined:
            return True
        while self.pub.poll(0):
            if self.pub.recv()[:1] == b"\x01":  # a subscription (b"\x00": one ended)
                self.joined = True
        return self.joined or time.monotonic() >= self.hold_until

    def _answer(self, held: collections.deque[tuple[int, bytes]]) -> None:
        assert self.router is not None
        identity, *frames = self.router.recv_multipart()
        request = frames[-1] if frames else b""
        reply = self.answer_request(request)
        if reply is not None:
            self.router.send_multipart([identity, b"", *reply])
            return
        if len(request) != 8:
            logger.warning("ignoring a replay request of %d bytes (not a seq)", len(request))
            return
        start = int.from_bytes(request, "big")
        for batch_seq, payload in held:
            if batch_seq >= start:
                self.router.send_multipart(
                    [identity, b"", self.topic, batch_seq.to_bytes(8, "big"), payload]
                )
        self.router.send_multipart([identity, b"", b"", END_OF_REPLAY, b""])

    def answer_request(self, request: bytes) -> list[bytes] | None:
        """Frames answering a request other than a replay's, or None (it is a replay)."""
        return None

    def close(self) -> None:
        self.queue.put(None)
        if self.thread.is_alive():
            self.thread.join(timeout=2)
        self.context.destroy(linger=0)
