"""What a step costs on this machine as a function of the tokens it computes, measured as the
engine runs, so the drafter can tell when a wider step pays.

On a CPU a decode step reads every weight once whatever the batch, so the first few extra
tokens in a step cost little (the step is bound by memory bandwidth) and later ones cost their
arithmetic (it is bound by compute): where that turn comes depends on the CPU, the model and
the context, which is why it is measured rather than assumed. Steps are grouped by their token
count in quarter-octave buckets; each bucket keeps its last few steps and reads as their
median (the first steps of an engine take many times longer while caches and allocators warm
up: a mean would carry them for hundreds of steps), and a count between buckets is read off
the line joining its neighbours.
"""

from __future__ import annotations

import bisect
import collections
import math
import statistics

# Steps each bucket remembers: enough for a stable median, few enough to follow a machine
# whose speed drifts (a VM's neighbours) within a few dozen steps.
_RECENT_STEPS = 15
# Before a count above every measured one has been seen: assume this many more tokens cost
# one more step's time (a bandwidth-bound CPU decode is flatter; the first wider steps measured
# replace the guess).
PRIOR_TOKENS_PER_STEP = 64


def bucket_of(tokens: int) -> int:
    return int(4 * math.log2(tokens)) if tokens > 0 else -1


class StepCostModel:
    """Seconds per step by tokens in the step, measured (`record`) and read (`seconds`)."""

    def __init__(self) -> None:
        self.buckets: dict[int, collections.deque[tuple[int, float]]] = {}
        # (tokens, seconds) of each bucket, by tokens: rebuilt on the first read after a record.
        self._points: list[tuple[float, float]] | None = None

    def record(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        bucket = self.buckets.get(bucket_of(tokens))
        if bucket is None:
            bucket = self.buckets[bucket_of(tokens)] = collections.deque(maxlen=_RECENT_STEPS)
        bucket.append((tokens, seconds))
        self._points = None

    def points(self) -> list[tuple[float, float]]:
        """Each bucket's (mean tokens, median seconds), by tokens."""
        if self._points is None:
            self._points = sorted(
                (
                    statistics.fmean(t for t, _ in steps),
                    statistics.median(s for _, s in steps),
                )
                for steps in self.buckets.values()
            )
        return self._points

    def seconds(self, tokens: int) -> float | None:
        """The estimated time of a step of `tokens` tokens (None: nothing measured yet)."""
        points = self.points()
        if not points:
            return None
        if tokens <= points[0][0]:
            return points[0][1]
        above = bisect.bisect_left(points, (tokens, -math.inf))
        if above < len(points):
            (low_tokens, low_seconds), (high_tokens, high_seconds) = (
                points[above - 1],
                points[above],
            )
            share = (tokens - low_tokens) / (high_tokens - low_tokens)
            return low_seconds + share * (high_seconds - low_seconds)
        top_tokens, top_seconds = points[-1]
        slope = 0.0
        if len(points) >= 2:
            slope = (top_seconds - points[-2][1]) / (top_tokens - points[-2][0])
        # Never flatter than the prior: one measured point says nothing of the slope.
        slope = max(slope, top_seconds / max(top_tokens, PRIOR_TOKENS_PER_STEP))
        return top_seconds + (tokens - top_tokens) * slope
