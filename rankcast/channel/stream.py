"""The notification stream for machines: every flushed `NotificationBatch` on a ZMQ PUB socket.

The framing and the replay socket are `SequencedPublisher`'s (vLLM's, which routers already
consume): `[topic, 8-byte big-endian seq, msgpack NotificationBatch]`, and a ROUTER socket that
replays from a start seq. On the same socket a subscriber may send `snapshot` instead and
receive `[b"", topic, seq, state]`: the engine's state snapshot, including every batch up to
`seq`, so a late subscriber starts from it and applies what follows.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from rankcast.channel.events import NotificationBatch
from rankcast.channel.sequenced_publisher import (
    END_OF_REPLAY,
    SequencedPublisher,
    endpoint_for_engine,
)
from rankcast.config import NotificationConfig

TOPIC = b"rankcast.channel.events"
SNAPSHOT_REQUEST = b"snapshot"
# The snapshot a subscriber gets is the engine's `EngineStateSnapshot` (rankcast/protocol.py);
# this module only encodes it, so it takes any struct and imports nothing above the channel.

__all__ = ["END_OF_REPLAY", "SNAPSHOT_REQUEST", "TOPIC", "NotificationPublisher"]


class NotificationPublisher(SequencedPublisher):
    def __init__(self, endpoint: str, replay_endpoint: str | None, engine_index: int) -> None:
        super().__init__(
            endpoint_for_engine(endpoint, engine_index),
            endpoint_for_engine(replay_endpoint, engine_index),
            TOPIC,
            name="notification-pub",
        )
        self.engine_index = engine_index
        self.encoder = msgspec.msgpack.Encoder()

    @classmethod
    def create(cls, config: NotificationConfig, engine_index: int) -> NotificationPublisher | None:
        if config.notification_events_endpoint is None:
            return None
        return cls(
            config.notification_events_endpoint,
            config.notification_events_replay_endpoint,
            engine_index,
        )

    def start_with(self, snapshot: Callable[[], msgspec.Struct]) -> None:
        """Start the socket thread, with the state a snapshot request gets before any batch."""
        if self.router is not None:
            self.set_state(self.encoder.encode(snapshot()))
        self.start()

    def publish_batch(
        self, notifications: list[msgspec.Raw], snapshot: Callable[[], msgspec.Struct]
    ) -> None:
        """Hand one flushed batch to the socket thread (called on the busy loop)."""
        payload = self.encoder.encode(
            NotificationBatch(time.time(), self.engine_index, notifications)
        )
        state = self.encoder.encode(snapshot()) if self.router is not None else None
        self.publish(payload, state)

    def answer_request(self, request: bytes) -> list[bytes] | None:
        if request == SNAPSHOT_REQUEST:
            return [self.topic, self.seq.to_bytes(8, "big", signed=True), self.state]
        return None
