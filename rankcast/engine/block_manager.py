"""Accounting of the paged KV cache: which blocks are free and which request owns which."""

from __future__ import annotations

from collections import deque

from rankcast.engine.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _missing(self, request: Request) -> int:
        # A step computes K/V for every token up to and including the newest one.
        return self.blocks_for(request.num_tokens) - len(request.block_ids)

    def can_allocate(self, request: Request) -> bool:
        return self._missing(request) <= len(self.free_blocks)

    def allocate(self, request: Request) -> None:
        """Give the request every block its next step needs (caller checked `can_allocate`)."""
        for _ in range(self._missing(request)):
            request.block_ids.append(self.free_blocks.popleft())

    def free(self, request: Request) -> None:
        self.free_blocks.extend(request.block_ids)
        request.block_ids = []

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1, as routers read `kv_cache_usage_perc`."""
        used = self.num_blocks - len(self.free_blocks)
        return used / self.num_blocks if self.num_blocks else 0.0
