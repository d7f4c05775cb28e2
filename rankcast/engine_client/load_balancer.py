"""Choosing a data-parallel engine core for each new request, from the load every engine
broadcasts.

Each engine core's scheduler stats reach every API server; between two stats messages an API
server also counts what it sent itself, so a burst does not all land on the engine that looked
idlest a moment ago. Ties rotate, so equal engines share work evenly.
"""

from __future__ import annotations

import itertools

from rankcast.protocol import SchedulerStats


class LoadBalancer:
    def __init__(self, num_engines: int) -> None:
        self.reported = [(0, 0)] * num_engines  # (waiting, running) from the last stats
        self.sent_since_report = [0] * num_engines
        self.rotation = itertools.count()

    def record_stats(self, engine: int, stats: SchedulerStats) -> None:
        self.reported[engine] = (stats.num_waiting_reqs, stats.num_running_reqs)
        self.sent_since_report[engine] = 0

    def choose(self, alive: list[bool]) -> int:
        """The live engine with the least (waiting, running) load; ties rotate."""
        loads = {
            engine: (waiting + self.sent_since_report[engine], running)
            for engine, (waiting, running) in enumerate(self.reported)
            if alive[engine]
        }
        if not loads:
            raise LookupError("no live engine core")
        best = min(loads.values())
        tied = [engine for engine, load in loads.items() if load == best]
        engine = tied[next(self.rotation) % len(tied)]
        self.sent_since_report[engine] += 1
        return engine
