"""A worker extension that publishes on demand: the producer the channel tests drive.

Used as `--worker-extension-cls tests.worker.producers:EventProducer` (and `worker_extension_cls`
in `LLM`), so its methods run in every rank through `collective_rpc`.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import msgspec

from rankcast.channel import CustomNotification, current_notification_buffer, publish

KEY = "test.event"


class RankReport(msgspec.Struct, array_like=True):
    """A struct an extension method returns: it must come back as itself on every executor."""

    rank: int
    layout: tuple[int, int]
    tags: list[str]


class EventProducer:
    rank: int

    def collector_state(self) -> tuple[bool, int]:
        """This rank's garbage collector: enabled, and how many objects start-up froze (not a
        producer's job, but every rank runs this class: rankcast/startup_gc.py's check)."""
        return gc.isenabled(), gc.get_freeze_count()

    def publish_events(self, count: int, key: str = KEY, ranks: list[int] | None = None) -> int:
        """Publish `count` events numbered 0.. from this rank (or only from `ranks`)."""
        if ranks is None or self.rank in ranks:
            for i in range(count):
                publish(CustomNotification(key=key, payload={"i": i, "rank": self.rank}))
        return self.rank

    def ray_node(self) -> str:
        """The Ray node this rank's actor runs on (ray executor only)."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def report(self) -> RankReport:
        return RankReport(self.rank, (self.rank, 0), ["a", "b"])

    def publish_bad_payload(self) -> int:
        """A payload msgpack cannot carry: must fail here, at the producer."""
        publish(CustomNotification(key=KEY, payload={"ok": [1, {"bad": {1, 2}}]}))
        return self.rank

    def publish_later(self, delay_s: float, key: str = KEY, ranks: list[int] | None = None) -> int:
        """Publish one event from a background thread after `delay_s`, with no call in flight:
        only the doorbell (or a poll) can bring it out."""
        if ranks is None or self.rank in ranks:

            def later() -> None:
                time.sleep(delay_s)
                publish(CustomNotification(key=key, payload={"rank": self.rank, "later": True}))

            threading.Thread(target=later, daemon=True).start()
        return self.rank

    def publish_from_own_thread(self, key: str = KEY) -> int:
        """Publish from a thread of this producer's own, through the buffer captured during
        the call: the way to reach the right engine where one process holds several."""
        buffer = current_notification_buffer()
        thread = threading.Thread(
            target=lambda: buffer.publish(CustomNotification(key=key, payload={"rank": self.rank}))
        )
        thread.start()
        thread.join()
        return self.rank

    def break_notification_drain(self, rank: int) -> int:
        """Fault injection: make this rank's next drains raise, as a broken rank would."""
        if self.rank == rank:

            def broken() -> Any:
                raise RuntimeError(f"injected failure draining notifications on rank {rank}")

            self.take_notifications = broken  # type: ignore[method-assign]
        return self.rank


def announce_plugin(worker: Any) -> None:
    """A `rankcast.worker_plugins` entry point: runs in every worker process at start-up."""
    publish(CustomNotification(key="test.plugin", payload={"rank": worker.rank}))
