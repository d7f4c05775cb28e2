"""A worker extension that generates notification load for bench/notifications.py.

Used as `--worker-extension-cls bench.event_load:EventLoad`; `start_event_load` runs in every
rank through `POST /collective_rpc` (or `LLM.collective_rpc`).
"""

from __future__ import annotations

import threading
import time

from rankcast.channel.events import CustomNotification


class EventLoad:
    rank: int
    _event_load: tuple[threading.Event, list[float]] | None = None

    def start_event_load(
        self, rate: float, seconds: float, key: str = "bench.load", publish: bool = True
    ) -> int:
        """Publish `rate` events per second for `seconds` from a background thread, paced in
        5 ms bursts so high rates are not limited by sleep granularity.

        With `publish=False` the thread wakes and counts the same way but publishes nothing:
        the control that separates the channel's cost from the cost of a busy extra thread.
        The thread adds up the CPU time of its bursts (`stop_event_load` returns it).
        """
        stop = threading.Event()
        spent = [0.0]
        self._event_load = (stop, spent)

        def load() -> None:
            start = time.perf_counter()
            sent = 0
            total = int(rate * seconds)
            while sent < total and not stop.is_set():
                due = min(total, int((time.perf_counter() - start) * rate) + 1)
                # CPU time of this thread, not wall time: being preempted by the rank's own
                # threads is not a cost the channel puts on them.
                began = time.thread_time()
                while sent < due:
                    if publish:
                        publish(CustomNotification(key=key, payload={"i": sent, "rank": self.rank}))
                    sent += 1
                spent[0] += time.thread_time() - began
                time.sleep(0.005)

        threading.Thread(target=load, name="event-load", daemon=True).start()
        return self.rank

    def stop_event_load(self) -> float:
        """Stop the load; the CPU seconds its bursts took on this rank."""
        if self._event_load is None:
            return 0.0
        stop, spent = self._event_load
        stop.set()
        self._event_load = None
        return spent[0]
