"""Rules 1-3 and the decoding rule: publish validates and stamps, the buffer bounds and counts,
drain is atomic and cheap when empty, and a receiver skips what it does not know."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import msgspec
import pytest

from rankcast.channel.buffer import NotificationBuffer
from rankcast.channel.decoder import NotificationDecoder
from rankcast.channel.doorbell import Doorbell
from rankcast.channel.events import CustomNotification, Notification, NotificationsDropped
from rankcast.protocol import EngineCoreMessage, EngineCoreOutputs

WIRE = Path(__file__).parent / "fixtures" / "wire"


def _event(i: int, key: str = "test.event") -> CustomNotification:
    return CustomNotification(key=key, payload={"i": i})


@pytest.mark.parametrize(
    ("payload", "error", "path"),
    [
        ({"ok": [1, {"bad": {1, 2}}]}, TypeError, "payload['ok'][1]['bad']"),
        ({"nested": {3: "int key"}}, TypeError, "payload['nested']"),
        ({"x": float("nan")}, ValueError, "payload['x']"),
        ({"big": 2**70}, ValueError, "payload['big']"),
        ({"obj": object()}, TypeError, "payload['obj']"),
    ],
)
def test_a_bad_payload_raises_naming_its_path(
    payload: dict, error: type[Exception], path: str
) -> None:
    buffer = NotificationBuffer()
    with pytest.raises(error, match=path.replace("[", r"\[").replace("]", r"\]")):
        buffer.publish(CustomNotification(key="k", payload=payload))
    assert buffer.take() is None, "nothing invalid is queued"


def test_non_notifications_empty_keys_and_huge_events_are_refused() -> None:
    buffer = NotificationBuffer()
    with pytest.raises(TypeError, match="CustomNotification"):
        buffer.publish({"key": "k"})  # type: ignore[arg-type]

    class Homemade(Notification, tag="homemade"):
        pass

    with pytest.raises(TypeError, match="Homemade"):
        buffer.publish(Homemade())
    with pytest.raises(TypeError, match="non-empty str"):
        buffer.publish(CustomNotification(key=""))
    with pytest.raises(ValueError, match="bytes encoded"):
        buffer.publish(CustomNotification(key="k", payload={"blob": "x" * 70_000}))
    assert buffer.take() is None


def test_publish_stamps_increasing_seq_and_a_timestamp() -> None:
    buffer = NotificationBuffer()
    for i in range(3):
        buffer.publish(_event(i))
    taken = buffer.take()
    assert taken is not None
    assert [n.seq for n in taken] == [1, 2, 3]
    assert all(n.timestamp > 0 for n in taken)
    assert [n.payload["i"] for n in taken] == [0, 1, 2]


def test_empty_drain_is_none_and_drain_empties() -> None:
    buffer = NotificationBuffer()
    assert buffer.take() is None
    buffer.publish(_event(0))
    assert buffer.take() is not None
    assert buffer.take() is None


def test_overflow_drops_the_oldest_reports_the_gap_first_and_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    buffer = NotificationBuffer(capacity=3)
    with caplog.at_level(logging.WARNING, logger="rankcast.channel.buffer"):
        for i in range(5):
            buffer.publish(_event(i))
        first = buffer.take()
        for i in range(5, 10):
            buffer.publish(_event(i))
        second = buffer.take()
    assert first is not None and second is not None
    head = first[0]
    assert isinstance(head, NotificationsDropped)
    assert (head.count, head.seq) == (2, 2), "seqs 1 and 2 were lost"
    assert [n.seq for n in first[1:]] == [3, 4, 5]
    assert isinstance(second[0], NotificationsDropped) and second[0].count == 2
    assert [n.seq for n in second[1:]] == [8, 9, 10]
    assert sum("buffer is full" in r.message for r in caplog.records) == 1


def test_concurrent_publish_and_drain_lose_nothing_but_counted_drops() -> None:
    buffer = NotificationBuffer(capacity=64)
    threads, per_thread = 4, 3000
    received: list[Notification] = []
    done = threading.Event()

    def drain() -> None:
        while not done.is_set():
            taken = buffer.take()
            if taken:
                received.extend(taken)
        received.extend(buffer.take() or [])

    def produce(t: int) -> None:
        for i in range(per_thread):
            buffer.publish(CustomNotification(key=f"t{t}", payload={"i": i}))

    drainer = threading.Thread(target=drain)
    drainer.start()
    producers = [threading.Thread(target=produce, args=(t,)) for t in range(threads)]
    for p in producers:
        p.start()
    for p in producers:
        p.join()
    done.set()
    drainer.join()
    events = [n for n in received if isinstance(n, CustomNotification)]
    dropped = sum(n.count for n in received if isinstance(n, NotificationsDropped))
    assert len(events) + dropped == threads * per_thread
    seqs = [n.seq for n in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    for t in range(threads):
        mine = [n.payload["i"] for n in events if n.key == f"t{t}"]
        assert mine == sorted(mine), "a producer's events keep their order"


def test_doorbell_rings_on_publish_and_take_clears_it() -> None:
    doorbell = Doorbell.create(2)
    buffer = NotificationBuffer(capacity=8, doorbell=doorbell, rank=1)
    assert doorbell.take() is False
    buffer.publish(_event(0))
    assert list(doorbell.flags) == [0, 1]
    assert doorbell.take() is True
    assert doorbell.take() is False


def test_unknown_types_are_skipped_and_named_while_known_ones_decode() -> None:
    known = msgspec.msgpack.encode(_event(7))
    future = msgspec.msgpack.encode({"type": "lora_adapter_teleported", "adapter": "a"})
    garbage = b"\xc1"
    decoded, unknown = NotificationDecoder().decode(
        [msgspec.Raw(future), msgspec.Raw(known), msgspec.Raw(garbage)]
    )
    assert [n.payload for n in decoded] == [{"i": 7}]  # type: ignore[attr-defined]
    assert unknown == ["lora_adapter_teleported", "?"]


def test_wire_fixture_notifications_decode_to_their_types() -> None:
    message = msgspec.msgpack.decode(
        (WIRE / "output_step.msgpack").read_bytes(), type=EngineCoreMessage
    )
    assert isinstance(message, EngineCoreOutputs) and message.engine_notifications
    (weights, experts), unknown = NotificationDecoder().decode(message.engine_notifications)
    assert unknown == []
    assert isinstance(weights, CustomNotification) and isinstance(experts, CustomNotification)
    assert (weights.key, weights.rank, weights.tp_rank, weights.engine_seq) == (
        "rankcast.weights_loaded",
        1,
        1,
        0,
    )
    assert (experts.key, experts.rank, experts.engine_seq) == ("rankcast.expert_load", 1, 2)


def test_the_producer_api_is_one_import_and_the_old_names_still_work_with_a_warning() -> None:
    """`from rankcast.channel import publish` is the producer's API; the two earlier homes of
    `publish_worker_notification` keep working for one release, each with a warning naming
    the new import, and publish into the same buffer."""
    import rankcast.channel
    import rankcast.notifications
    import rankcast.worker.notification_buffer

    buffer = NotificationBuffer()
    with buffer.current():
        rankcast.channel.publish(_event(0))
        with pytest.warns(DeprecationWarning, match=r"from rankcast.channel import publish"):
            old_publish = rankcast.worker.notification_buffer.publish_worker_notification
        old_publish(_event(1))
        with pytest.warns(DeprecationWarning, match=r"from rankcast.channel import publish"):
            older_publish = rankcast.notifications.publish_worker_notification
        older_publish(_event(2))
    with pytest.warns(DeprecationWarning, match=r"rankcast.channel"):
        assert rankcast.notifications.CustomNotification is CustomNotification
    taken = buffer.take()
    assert taken is not None
    assert [n.payload["i"] for n in taken] == [0, 1, 2]  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        rankcast.notifications.nothing_here  # noqa: B018
