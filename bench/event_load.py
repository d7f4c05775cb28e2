"""A worker extension that generates notification load for bench/notifications.py.

Used as `--worker-extension-cls bench.event_load:EventLoad`; `start_event_load` runs in every
rank through `POST /collective_rpc` (or `LLM.collective_rpc`).
"""

from __future__ import annotations

import threading
import time

from rankcast.notifications import CustomNotification
from rankcast.worker.notification_buffer import publish_worker_notification


class EventLoad:
    rank: int

    def start_event_load(
        self, rate: float, seconds: float, key: str = "bench.load", publish: bool = True
    ) -> int:
        """Publish `rate` events per second for `seconds` from a background thread, paced in
        5 ms bursts so high rates are not limited by sleep granularity.

        With `publish=False` the thread wakes and counts the same way but publishes nothing:
        the control that separates the channel's cost from the cost of a busy extra thread.
        """

        def load() -> None:
            start = time.perf_counter()
            sent = 0
            total = int(rate * seconds)
            while sent < total:
                due = min(total, int((time.perf_counter() - start) * rate) + 1)
                while sent < due:
                    if publish:
                        publish_worker_notification(
                            CustomNotification(key=key, payload={"i": sent, "rank": self.rank})
                        )
                    sent += 1
                time.sleep(0.005)

        threading.Thread(target=load, name="event-load", daemon=True).start()
        return self.rank
