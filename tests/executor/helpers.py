"""Functions run inside worker ranks by `collective_rpc` (referenced as `module:qualname`).

They inject faults that a healthy model never produces: a rank that raises, a rank that is slow.
"""

from __future__ import annotations

import time

from rankcast.worker.worker import Worker


def fail_on_rank(worker: Worker, rank: int, delay_others_s: float = 0.0) -> int:
    if worker.rank == rank:
        raise ValueError(f"injected failure on rank {rank}")
    time.sleep(delay_others_s)
    return worker.rank


def sleep_on_rank(worker: Worker, rank: int, seconds: float) -> int:
    if worker.rank == rank:
        time.sleep(seconds)
    return worker.rank


def own_pid(worker: Worker) -> int:
    import os

    return os.getpid()


def publish_on_rank(worker: Worker, rank: int, count: int) -> int:
    """Publish `count` test events from `rank` now (no gather follows a plain collective)."""
    from rankcast.channel import publish
    from rankcast.channel.events import CustomNotification

    if worker.rank == rank:
        for i in range(count):
            publish(CustomNotification(key="test.ray", payload={"i": i}))
    return worker.rank


def publish_later_on_rank(worker: Worker, rank: int, delay_s: float) -> int:
    """Publish one test event from `rank` on a thread after the call has returned."""
    import threading

    from rankcast.channel import publish
    from rankcast.channel.events import CustomNotification

    def later() -> None:
        time.sleep(delay_s)
        publish(CustomNotification(key="test.ray", payload={"later": True}))

    if worker.rank == rank:
        threading.Thread(target=later, daemon=True).start()
    return worker.rank
