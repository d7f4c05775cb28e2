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

    def _missing(self, request: Request, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(request.block_ids))

    def can_allocate(self, request: Request, num_tokens: int) -> bool:
        """Whether the request can hold K/V for its first `num_tokens` tokens."""
        return self._missing(request, num_tokens) <= len(self.free_blocks)

    def allocate(self, request: Request, num_tokens: int) -> None:
        """Give the request the blocks for its first `num_tokens` tokens (caller checked)."""
        for _ in range(self._missing(request, num_tokens)):
            request.block_ids.append(self.free_blocks.popleft())

    def free(self, request: Request) -> None:
        self.free_blocks.extend(request.block_ids)
        request.block_ids = []

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1, as routers read `kv_cache_usage_perc`."""
        used = self.num_blocks - len(self.free_blocks)
        return used / self.num_blocks if self.num_blocks else 0.0
