"""The KV cache of a model whose layers form two groups: those attending to the whole context and
those with a sliding window (Gemma 3's five local layers per global one; Qwen2's and Qwen3's
with `use_sliding_window` from `max_window_layers` on).

Each group has its own pool of blocks (its layers' caches are sized by it: `KVCacheSplit`) and
each request a block table in each (`Request.kv_groups`), kept by one `BlockManager` per group.
The windowed group hands back blocks once they fall behind the window, so on those layers a
long sequence holds about a window's worth of blocks whatever its length, and their pool is
sized for the window, not for the context: the memory saved goes to the full group's pool.

A prefix-cache hit must hold for both groups at once, as vLLM's hybrid allocator has it: the
full group needs every block up to the hit's end, the windowed group only the blocks of the
window before it; the hit is the furthest point both can start from (`match_prefix`). Both
groups publish their KV events, each saying its group (`group_idx`, as vLLM's events do for
hybrid models): the full group's blocks are the ones a prefix index matches from the start of a
prompt, the windowed group's tell which windows are still held.

The scheduler talks to this as to a single `BlockManager` (same methods).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rankcast.channel.events import KVCacheCleared, KVCacheEvent
from rankcast.engine_core.block_manager import BlockManager
from rankcast.engine_core.request import Request


@dataclass(frozen=True)
class KVCacheSplit:
    """How many blocks each group's pool has (the windowed group's 0 where the model has
    none)."""

    full_blocks: int
    window_blocks: int


def window_pool_cap(window: int, block_size: int, max_num_seqs: int, step_tokens: int) -> int:
    """The most blocks a windowed group can ever have in use: every running sequence's window
    (spanning one block more than it covers, and one more for a token that opens a block),
    the blocks a step's new tokens open, and the null block."""
    per_sequence = math.ceil((window - 1) / block_size) + 2
    return max_num_seqs * per_sequence + math.ceil(step_tokens / block_size) + 1


def split_cache(budgets: list[tuple[int, int, int]], window_cap: int) -> KVCacheSplit:
    """The pools' sizes from each rank's (budget bytes, bytes of a full-group block, bytes of
    a windowed-group block) (a rank without one of the groups' layers has 0 there): the
    windowed pool as large as the full one, or `window_cap` blocks when that is less, and the
    full pool every byte left; the same sizes on every rank (block ids are shared), so each
    fits the tightest rank."""
    windowed = any(w for _, _, w in budgets)
    full = any(f for _, f, _ in budgets)
    if not windowed:
        return KVCacheSplit(min(b // f for b, f, _ in budgets if f), 0)
    if not full:
        return KVCacheSplit(0, min(b // w for b, _, w in budgets if w))
    equal = min(b // (f + w) for b, f, w in budgets if f + w)
    window_blocks = max(2, min(window_cap, equal))
    full_blocks = min((b - window_blocks * w) // f for b, f, w in budgets if f)
    return KVCacheSplit(max(1, full_blocks), window_blocks)


class KVCacheManager:
    """Two `BlockManager`s, the full group's (0) and the windowed group's (1), as one."""

    def __init__(self, full: BlockManager, windowed: BlockManager) -> None:
        assert full.group == 0 and windowed.group == 1 and windowed.window > 0
        assert full.block_size == windowed.block_size
        self.full = full
        self.windowed = windowed
        self.groups = (full, windowed)
        self.block_size = full.block_size
        self.num_blocks = full.num_blocks
        self.enable_prefix_caching = full.enable_prefix_caching
        self.kv_events = full.kv_events

    @property
    def queried_tokens(self) -> int:
        return self.full.queried_tokens

    @property
    def hit_tokens(self) -> int:
        return self.full.hit_tokens

    def can_allocate(self, request: Request, num_tokens: int) -> bool:
        return all(group.can_allocate(request, num_tokens) for group in self.groups)

    def allocate(self, request: Request, num_tokens: int) -> None:
        for group in self.groups:
            group.allocate(request, num_tokens)

    def free(self, request: Request) -> None:
        for group in self.groups:
            group.free(request)

    def begin_step(self) -> None:
        for group in self.groups:
            group.begin_step()

    def plan_computed(self, request: Request, num_tokens: int) -> None:
        for group in self.groups:
            group.plan_computed(request, num_tokens)

    def match_prefix(self, request: Request) -> int:
        """The furthest point both groups can start the request from: the full group's cached
        run, shortened until the windowed group holds the window before it."""
        blocks = self.full.cached_blocks(request)
        while blocks and not self.windowed.hit_possible(request, blocks):
            blocks -= 1
        if not blocks:
            return 0
        for group in self.groups:
            group.take_prefix(request, blocks)
        request.num_computed_tokens = blocks * self.block_size
        return request.num_computed_tokens

    def record_lookup(self, queried: int, hit: int) -> None:
        self.full.record_lookup(queried, hit)

    def cache_computed_blocks(self, request: Request) -> None:
        for group in self.groups:
            group.cache_computed_blocks(request)

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The step's events of the full group, then the windowed group's (the first event of
        an incarnation, `KVCacheCleared`, only once)."""
        windowed = [e for e in self.windowed.take_kv_events() if not isinstance(e, KVCacheCleared)]
        return self.full.take_kv_events() + windowed

    def reset_prefix_cache(self) -> bool:
        if any(len(g.free_blocks) != g.usable_blocks for g in self.groups):
            return False
        return all(group.reset_prefix_cache() for group in self.groups)

    @property
    def usage(self) -> float:
        """The fuller pool's use: the one that runs out first."""
        return max(group.usage for group in self.groups)
