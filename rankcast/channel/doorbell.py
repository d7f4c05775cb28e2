"""The doorbell: how an idle engine core learns that a rank published, without an RPC (rule 5)."""

from __future__ import annotations

from typing import Any


class Doorbell:
    """One byte per rank in shared memory: publish sets its rank's byte, the engine core reads
    and clears them after a step, so a quiet channel costs no RPC and no system call.

    Built by the executor (`multiprocessing` shared memory travels to spawned ranks as an
    argument); the in-process executor uses one for its single rank the same way.
    """

    def __init__(self, flags: Any) -> None:
        self.flags = flags

    @classmethod
    def create(cls, num_ranks: int, context: Any = None) -> Doorbell:
        import multiprocessing

        ctx = context or multiprocessing.get_context("spawn")
        return cls(ctx.RawArray("b", num_ranks))

    def ring(self, rank: int) -> None:
        self.flags[rank] = 1

    def clear(self, rank: int) -> None:
        """The rank drained its own buffer (into a step's reply): nothing left to gather."""
        self.flags[rank] = 0

    def take(self) -> bool:
        """True if any rank rang since the last take; clears them first, so a ring that lands
        during the gather that follows is seen next time rather than lost."""
        flags = self.flags
        if not any(flags):
            return False
        for i in range(len(flags)):
            flags[i] = 0
        return True
