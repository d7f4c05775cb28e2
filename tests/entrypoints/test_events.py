"""The API server's consumers on their own: unknown types, the replay ring, slow readers.

These feed real encoded notifications to the real sinks (metrics registry, event hub) through
the same decoding path the output loop uses; a version-skewed engine is the only way to meet an
unknown type, so it is built here by encoding one by hand.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from rankcast.api_server.events import DEFAULT_RING_SIZE, EventFilter, EventHub
from rankcast.api_server.metrics.prometheus import ServerMetrics
from rankcast.channel.events import CustomNotification, Notification
from rankcast.channel.snapshot import (
    EngineStateSnapshot,
    NotificationLedgerState,
    NotificationTotal,
    RankCount,
    RankWeightsLoaded,
)
from rankcast.engine_client.async_llm import AsyncLLM
from rankcast.engine_client.engine_views import EngineViews


def _raw(value: object) -> msgspec.Raw:
    return msgspec.Raw(msgspec.msgpack.encode(value))


def _event(seq: int, key: str = "k") -> msgspec.Raw:
    return _raw(CustomNotification(key=key, engine_seq=seq, engine_index=0, rank=0, seq=seq + 1))


def _frames(chunks: list[bytes]) -> list[str]:
    return [line[4:] for c in chunks for line in c.decode().splitlines() if line.startswith("id: ")]


async def _collect(hub: EventHub, last_event_id: str | None, n: int, flt: EventFilter) -> list:
    """Up to `n` frames (events and control events) of a stream; what arrived when none came
    for 5 s (so a stream that replays too little fails its test instead of hanging it)."""
    chunks: list[bytes] = []
    stream = hub.stream(flt, last_event_id)
    while len(_frames(chunks)) + sum(b"event: " in c for c in chunks) < n:
        try:
            chunks.append(await asyncio.wait_for(anext(stream), 5))
        except (TimeoutError, StopAsyncIteration):
            break
    await stream.aclose()
    return chunks


def hub_over(views: EngineViews, ring_size: int = DEFAULT_RING_SIZE) -> EventHub:
    return EventHub(views, ring_size)


def deliver(hub: EventHub, notifications: list[Notification]) -> None:
    """A batch as the output loop delivers it: the views apply it, then the hub streams it."""
    hub.views.consume(0, notifications, [])
    hub.consume(0, notifications, [], 0.0)


def restart(hub: EventHub, snapshot: EngineStateSnapshot) -> None:
    hub.views.apply_snapshot(snapshot)
    hub.apply_snapshot(snapshot)


def test_an_unknown_type_is_counted_and_skipped_and_the_rest_delivered() -> None:
    views = EngineViews(1)
    metrics, hub = ServerMetrics("m", 0, views), EventHub(views)
    llm = AsyncLLM([], tokenizer=None, observer=metrics, sinks=[metrics, hub], views=views)
    future = _raw({"type": "teleported", "engine_seq": 1, "adapter": "x"})
    llm._deliver_notifications(0, [_event(0), future, _event(2)])
    text = metrics.exposition().decode()
    assert 'rankcast:engine_notifications_skipped_total{type="teleported"} 1.0' in text
    assert 'rankcast:engine_notifications_total{key="k",type="custom"} 2.0' in text
    assert [e.id for e in hub.ring] == ["0:0:0", "0:0:2"]


def test_a_snapshot_starts_the_counters_where_the_engine_is() -> None:
    views = EngineViews(2)
    metrics = ServerMetrics("m", 0, views)
    snapshot = EngineStateSnapshot(
        1,
        41,
        NotificationLedgerState(
            totals=[
                NotificationTotal("custom", "k", 40),
                NotificationTotal("notifications_dropped", "", 2),
            ],
            dropped=[RankCount(3, 17), RankCount(-1, 5)],
            weights_loaded=[RankWeightsLoaded(3, {"bytes": 10, "seconds": 0.5})],
        ),
    )
    views.apply_snapshot(snapshot)
    metrics.apply_snapshot(snapshot)
    text = metrics.exposition().decode()
    assert 'rankcast:engine_notifications_total{key="k",type="custom"} 40.0' in text
    assert 'rankcast:worker_notifications_dropped_total{engine="1",rank="3"} 17.0' in text
    assert 'rankcast:worker_notifications_dropped_total{engine="1",rank="engine_core"} 5.0' in text
    assert 'rankcast:worker_weights_load_seconds{engine="1",rank="3"} 0.5' in text


def test_resume_replays_what_was_missed_and_filters_apply() -> None:
    async def run() -> None:
        hub = hub_over(EngineViews(1), ring_size=8)
        deliver(
            hub,
            [
                msgspec.msgpack.decode(_event(i, "a" if i % 2 else "b"), type=CustomNotification)
                for i in range(6)
            ],
        )
        chunks = await _collect(hub, "0:2", 3, EventFilter())
        assert _frames(chunks) == ["0:0:3", "0:0:4", "0:0:5"]
        only_a = await _collect(hub, "0:0", 3, EventFilter.parse(None, "a"))
        assert _frames(only_a) == ["0:0:1", "0:0:3", "0:0:5"]

    asyncio.run(run())


def test_a_resume_point_the_ring_no_longer_holds_gets_a_gap_event() -> None:
    async def run() -> None:
        hub = hub_over(EngineViews(1), ring_size=4)
        deliver(
            hub, [msgspec.msgpack.decode(_event(i), type=CustomNotification) for i in range(10)]
        )
        chunks = await _collect(hub, "0:1", 5, EventFilter())
        text = b"".join(chunks).decode()
        assert "event: replay_gap" in text and '"oldest_event_id": "0:0:6"' in text
        assert _frames(chunks) == ["0:0:6", "0:0:7", "0:0:8", "0:0:9"]
        # Right after the newest known event: nothing is missing, no gap.
        restart(hub, EngineStateSnapshot(0, 9))
        assert hub._replay("0:9") == ([], None)

    asyncio.run(run())


def test_a_resume_point_from_before_an_engine_restart_gets_a_gap_event() -> None:
    """Ids carry the incarnation; a reader resuming from the dead incarnation's id is told the
    engine restarted and gets what the ring holds after its id, both incarnations' events."""

    def decoded(seqs: range) -> list[CustomNotification]:
        return [msgspec.msgpack.decode(_event(i), type=CustomNotification) for i in seqs]

    async def run() -> None:
        hub = hub_over(EngineViews(1))
        deliver(hub, decoded(range(4)))
        restart(hub, EngineStateSnapshot(0, -1, incarnation=1))  # the restarted engine
        deliver(hub, decoded(range(2)))
        assert [e.id for e in hub.ring][-3:] == ["0:0:3", "0:1:0", "0:1:1"]
        chunks = await _collect(hub, "0:0:1", 5, EventFilter())
        text = b"".join(chunks).decode()
        assert "event: replay_gap" in text and "restarted (incarnation 0 -> 1)" in text
        assert _frames(chunks) == ["0:0:2", "0:0:3", "0:1:0", "0:1:1"]
        # The current incarnation resumes as before: no gap.
        assert hub._replay("0:1:0") == (list(hub.ring)[-1:], None)

    asyncio.run(run())


def test_a_too_slow_reader_is_told_and_disconnected() -> None:
    async def run() -> None:
        hub = hub_over(EngineViews(1))
        stream = hub.stream(EventFilter(), None)
        assert (await stream.__anext__()).startswith(b":")
        (subscriber,) = hub.subscribers
        batch = [msgspec.msgpack.decode(_event(i), type=CustomNotification) for i in range(3)]
        subscriber.queue = asyncio.Queue(maxsize=2)
        deliver(hub, batch)
        got = [await stream.__anext__() for _ in range(3)]
        assert b"event: overflow" in got[-1]
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        assert not hub.subscribers

    asyncio.run(run())


def test_closing_the_hub_ends_open_streams() -> None:
    async def run() -> None:
        hub = hub_over(EngineViews(1))
        stream = hub.stream(EventFilter(), None)
        assert (await stream.__anext__()).startswith(b":")
        hub.close()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(stream.__anext__(), 5)
        assert not hub.subscribers

    asyncio.run(run())
