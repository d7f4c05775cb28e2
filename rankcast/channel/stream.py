"""The notification stream for machines: a ZMQ PUB socket with a ROUTER replay socket.

Frames are `[topic, 8-byte big-endian seq, msgpack NotificationBatch]`, the framing routers
already consume for KV-cache events. A subscriber that missed frames (seq gap) or joins late asks
the replay socket for a start seq (8 bytes) and receives every batch still held from there,
then an end marker (seq -1, empty payload); or sends `snapshot` and receives the engine's state
snapshot tagged with the seq of the last batch it includes. Sockets live on their own thread so
the busy loop only hands over bytes.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import msgspec
import zmq

from rankcast.channel.events import NotificationBatch
from rankcast.config import NotificationConfig

logger = logging.getLogger(__name__)

TOPIC = b"rankcast.channel.events"
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
SNAPSHOT_REQUEST = b"snapshot"
_REPLAY_BATCHES = 10_000
# The snapshot a subscriber gets is the engine's `EngineStateSnapshot` (rankcast/protocol.py);
# this module only encodes it, so it takes any struct and imports nothing above the channel.


def endpoint_for_engine(endpoint: str, engine_index: int) -> str:
    """Each data-parallel engine core gets its own endpoint: tcp ports count up, ipc paths get
    a suffix (engine 0 keeps the endpoint as given)."""
    if engine_index == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        parts = urlsplit(endpoint)
        host, _, port = parts.netloc.rpartition(":")
        return f"tcp://{host}:{int(port) + engine_index}"
    return f"{endpoint}_dp{engine_index}"


class NotificationPublisher:
    def __init__(self, endpoint: str, replay_endpoint: str | None, engine_index: int) -> None:
        self.endpoint = endpoint_for_engine(endpoint, engine_index)
        self.replay_endpoint = (
            endpoint_for_engine(replay_endpoint, engine_index) if replay_endpoint else None
        )
        self.engine_index = engine_index
        self.encoder = msgspec.msgpack.Encoder()
        # (batch, state after it); a batch of None carries only the initial state.
        self.queue: queue.Queue[tuple[bytes | None, bytes | None] | None] = queue.Queue()
        self.context = zmq.Context()
        # Bind now, so a bad endpoint fails the engine's start-up with its name.
        self.pub = self.context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(self.endpoint)
        self.router: zmq.Socket[bytes] | None = None
        if self.replay_endpoint:
            self.router = self.context.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(self.replay_endpoint)
        self.thread = threading.Thread(target=self._run, name="notification-pub", daemon=True)

    @classmethod
    def create(cls, config: NotificationConfig, engine_index: int) -> NotificationPublisher | None:
        if config.notification_events_endpoint is None:
            return None
        return cls(
            config.notification_events_endpoint,
            config.notification_events_replay_endpoint,
            engine_index,
        )

    def start(self, snapshot: Callable[[], msgspec.Struct]) -> None:
        """Start the socket thread, with the state a snapshot request gets before any batch."""
        if self.router is not None:
            self.queue.put((None, self.encoder.encode(snapshot())))
        self.thread.start()

    def publish(
        self, notifications: list[msgspec.Raw], snapshot: Callable[[], msgspec.Struct]
    ) -> None:
        """Hand one flushed batch to the socket thread (called on the busy loop)."""
        payload = self.encoder.encode(
            NotificationBatch(time.time(), self.engine_index, notifications)
        )
        state = self.encoder.encode(snapshot()) if self.router is not None else None
        self.queue.put((payload, state))

    def _run(self) -> None:
        held: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=_REPLAY_BATCHES)
        seq = -1
        state = b""
        while True:
            try:
                item = self.queue.get(timeout=0.01 if self.router is not None else None)
            except queue.Empty:
                item = (None, None)  # nothing new: only look at the replay socket
            if item is None:
                return
            payload, state_now = item
            if payload is not None:
                seq += 1
                self.pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])
                held.append((seq, payload))
            if state_now is not None:
                state = state_now
            if self.router is not None and self.router.poll(0):
                self._answer(held, seq, state)

    def _answer(self, held: collections.deque[tuple[int, bytes]], seq: int, state: bytes) -> None:
        identity, *frames = self.router.recv_multipart()  # type: ignore[union-attr]
        request = frames[-1] if frames else b""
        send = self.router.send_multipart  # type: ignore[union-attr]
        if request == SNAPSHOT_REQUEST:
            send([identity, b"", seq.to_bytes(8, "big", signed=True), state])
            return
        start = int.from_bytes(request[:8], "big", signed=True)
        for batch_seq, payload in held:
            if batch_seq >= start:
                send([identity, b"", batch_seq.to_bytes(8, "big"), payload])
        send([identity, b"", END_OF_REPLAY, b""])

    def close(self) -> None:
        self.queue.put(None)
        if self.thread.is_alive():
            self.thread.join(timeout=2)
        self.context.destroy(linger=0)
