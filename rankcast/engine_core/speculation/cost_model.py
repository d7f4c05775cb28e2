"""What a step costs on this machine as a function of the tokens it computes, measured as the
engine runs, so the drafter can tell when a wider step pays.

On a CPU a decode step reads every weight once whatever the batch, so the first few extra
tokens in a step cost little (the step is bound by memory bandwidth) and later ones cost their
arithmetic (it is bound by compute): where that turn comes depends on the CPU, the model and
the context, which is why it is measured rather than assumed. Steps are grouped by their token
count in quarter-octave buckets; each bucket keeps a moving average of its steps' token count
and seconds, and a count between buckets is read off the line joining its neighbours.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

# Weight of a new step in its bucket's moving average: a few dozen steps make the estimate,
# and a machine whose speed drifts (a VM's neighbours) is followed within as many.
_SMOOTHING = 0.1
# Before a count above every measured one has been seen: assume this many more tokens cost
# one more step's time (a bandwidth-bound CPU decode is flatter; the first wider steps measured
# replace the guess).
PRIOR_TOKENS_PER_STEP = 64


@dataclass
class _Bucket:
    tokens: float
    seconds: float
    steps: int = 0


def bucket_of(tokens: int) -> int:
    return int(4 * math.log2(tokens)) if tokens > 0 else -1


class StepCostModel:
    """Seconds per step by tokens in the step, measured (`record`) and read (`seconds`)."""

    def __init__(self) -> None:
        self.buckets: dict[int, _Bucket] = {}

    def record(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        bucket = self.buckets.get(bucket_of(tokens))
        if bucket is None:
            self.buckets[bucket_of(tokens)] = _Bucket(tokens, seconds, 1)
            return
        weight = max(_SMOOTHING, 1 / (bucket.steps + 1))
        bucket.tokens += weight * (tokens - bucket.tokens)
        bucket.seconds += weight * (seconds - bucket.seconds)
        bucket.steps += 1

    def seconds(self, tokens: int) -> float | None:
        """The estimated time of a step of `tokens` tokens (None: nothing measured yet)."""
        if not self.buckets:
            return None
        points = sorted((b.tokens, b.seconds) for b in self.buckets.values())
        if tokens <= points[0][0]:
            return points[0][1]
        for (low_tokens, low_seconds), (high_tokens, high_seconds) in itertools.pairwise(points):
            if tokens <= high_tokens:
                share = (tokens - low_tokens) / (high_tokens - low_tokens)
                return low_seconds + share * (high_seconds - low_seconds)
        top_tokens, top_seconds = points[-1]
        if len(points) >= 2:
            slope = (top_seconds - points[-2][1]) / (top_tokens - points[-2][0])
        else:
            slope = 0.0
        # Never flatter than the prior: one measured point says nothing of the slope.
        slope = max(slope, top_seconds / max(top_tokens, PRIOR_TOKENS_PER_STEP))
        return top_seconds + (tokens - top_tokens) * slope
