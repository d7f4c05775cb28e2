"""`/v1/events`: engine notifications as a server-sent-event stream, resumable from a ring.

Each event is one notification as JSON with `id: <engine>:<incarnation>:<engine_seq>` (the
incarnation counts the engine core's restarts; its sequence starts over with each). Every API
server keeps the same bounded ring (the engine core sends every server the same stream in the
same order), so a client that reconnects with `Last-Event-ID` — even to a sibling behind the same
port — gets exactly what it missed, or a `replay_gap` event saying the ring no longer holds its
id, or that the engine restarted since (what its dead incarnation had not yet sent is lost).
A subscriber that reads too slowly is told so (`overflow`) and disconnected, never allowed to
hold the server's memory hostage.
"""

from __future__ import annotations

import asyncio
import collections
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec

from rankcast.channel.events import CustomNotification, Notification, notification_type
from rankcast.channel.snapshot import EngineStateSnapshot
from rankcast.channel.view import EngineView
from rankcast.engine_client.engine_views import EngineViews

DEFAULT_RING_SIZE = 4096
_SUBSCRIBER_QUEUE = 10_000
_KEEPALIVE_S = 15.0


@dataclass(frozen=True)
class Event:
    engine: int
    seq: int
    type: str
    key: str
    data: bytes
    incarnation: int = 0

    @property
    def id(self) -> str:
        return f"{self.engine}:{self.incarnation}:{self.seq}"

    def frame(self) -> bytes:
        return b"id: " + self.id.encode() + b"\ndata: " + self.data + b"\n\n"


@dataclass
class EventFilter:
    types: frozenset[str] = frozenset()
    keys: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, types: str | None, keys: str | None) -> EventFilter:
        def split(value: str | None) -> frozenset[str]:
            return frozenset(v.strip() for v in (value or "").split(",") if v.strip())

        return cls(split(types), split(keys))

    def matches(self, event: Event) -> bool:
        if self.types and event.type not in self.types:
            return False
        return not self.keys or event.key in self.keys


@dataclass(eq=False)
class _Subscriber:
    queue: asyncio.Queue[Event | None] = field(
        default_factory=lambda: asyncio.Queue(maxsize=_SUBSCRIBER_QUEUE)
    )
    overflowed: bool = False


def control_frame(name: str, body: dict[str, object]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(body)}\n\n".encode()


def parse_event_id(value: str) -> tuple[int, int, int]:
    """`engine:incarnation:seq` -> (engine, incarnation, seq); the older `engine:seq` is
    incarnation 0. ValueError with the expected form otherwise."""
    parts = value.split(":")
    if len(parts) not in (2, 3):
        raise ValueError(f"Last-Event-ID {value!r} is not of the form <engine>:<incarnation>:<seq>")
    numbers = [int(part) for part in parts]
    if len(numbers) == 2:
        numbers.insert(1, 0)
    return numbers[0], numbers[1], numbers[2]


class EventHub:
    """The ring and the live subscribers of one API server (a NotificationSink)."""

    def __init__(self, views: EngineViews, ring_size: int = DEFAULT_RING_SIZE) -> None:
        self.ring: collections.deque[Event] = collections.deque(maxlen=ring_size)
        self.subscribers: set[_Subscriber] = set()
        # Each engine's incarnation and newest engine_seq, as its view has them.
        self.views = views
        self.encoder = msgspec.json.Encoder()

    def apply_snapshot(self, snapshot: EngineStateSnapshot) -> None:
        """Nothing to do: a new incarnation's ids follow from its view."""

    def consume(
        self, engine: int, notifications: list[Notification], unknown: list[str], now: float
    ) -> None:
        for n in notifications:
            key = n.key if isinstance(n, CustomNotification) else ""
            event = Event(
                n.engine_index,
                n.engine_seq,
                notification_type(n),
                key,
                self.encoder.encode(n),
                self._view(n.engine_index, engine).incarnation,
            )
            self.ring.append(event)
            for subscriber in self.subscribers:
                if subscriber.overflowed:
                    continue
                try:
                    subscriber.queue.put_nowait(event)
                except asyncio.QueueFull:
                    subscriber.overflowed = True

    def _view(self, engine: int, fallback: int) -> EngineView:
        return self.views[engine if 0 <= engine < len(self.views) else fallback]

    def close(self) -> None:
        """End every open stream (the server is shutting down): streams would otherwise hold
        the graceful shutdown until its timeout."""
        for subscriber in self.subscribers:
            subscriber.overflowed = True  # nothing more is queued for it
            while True:
                try:
                    subscriber.queue.put_nowait(None)
                    break
                except asyncio.QueueFull:
                    subscriber.queue.get_nowait()

    def _replay(self, last_event_id: str | None) -> tuple[list[Event], bytes | None]:
        """What a resuming client missed, and the gap notice when the ring cannot say."""
        ring = list(self.ring)
        if last_event_id is None:
            return [], None
        engine, incarnation, seq = parse_event_id(last_event_id)
        current = self._view(engine, engine).incarnation if 0 <= engine < len(self.views) else 0
        if incarnation != current:
            # The engine core restarted since: what its old incarnation published but never
            # sent is lost. Replay what the ring holds after the id, and say so.
            after = next(
                (
                    i + 1
                    for i, e in enumerate(ring)
                    if (e.engine, e.incarnation, e.seq) == (engine, incarnation, seq)
                ),
                0,
            )
            return ring[after:], control_frame(
                "replay_gap",
                {
                    "last_event_id": last_event_id,
                    "oldest_event_id": ring[after].id if after < len(ring) else None,
                    "message": f"engine {engine} restarted (incarnation {incarnation} -> "
                    f"{current}); events its old incarnation had not sent are lost",
                },
            )
        for i, event in enumerate(ring):
            if (event.engine, event.incarnation, event.seq) == (engine, incarnation, seq):
                return ring[i + 1 :], None
        own = [
            i
            for i, event in enumerate(ring)
            if event.engine == engine and event.incarnation == incarnation
        ]
        if own and ring[own[0]].seq == seq + 1:
            return ring[own[0] :], None
        last_seq = self.views[engine].engine_seq if 0 <= engine < len(self.views) else -1
        if not own and seq >= last_seq:
            return [], None
        notice = control_frame(
            "replay_gap",
            {
                "last_event_id": last_event_id,
                "oldest_event_id": ring[0].id if ring else None,
                "message": "events after this id are no longer held; replaying what is",
            },
        )
        return ring, notice

    async def stream(
        self, event_filter: EventFilter, last_event_id: str | None
    ) -> AsyncIterator[bytes]:
        # Subscribing and copying the ring happen with no await in between, so no event is
        # both replayed and delivered live, and none falls between the two.
        subscriber = _Subscriber()
        self.subscribers.add(subscriber)
        try:
            replay, notice = self._replay(last_event_id)
            yield b": rankcast event stream\n\n"
            if notice is not None:
                yield notice
            for event in replay:
                if event_filter.matches(event):
                    yield event.frame()
            while True:
                if subscriber.overflowed and subscriber.queue.empty():
                    yield control_frame(
                        "overflow",
                        {"message": "reader too slow; reconnect with Last-Event-ID to resume"},
                    )
                    return
                try:
                    live = await asyncio.wait_for(subscriber.queue.get(), _KEEPALIVE_S)
                except TimeoutError:
                    yield b": keepalive\n\n"
                    continue
                if live is None:
                    return
                if event_filter.matches(live):
                    yield live.frame()
        finally:
            self.subscribers.discard(subscriber)
