"""Accounting of the paged KV cache: free blocks, which request owns which, and the prefix cache.

With prefix caching, each full block a request computes is named by a hash chain over (the
previous block's hash, the block's token ids, the adapter that computed it), so equal prefixes
have equal names while a different adapter or a different earlier token gives another. A freed
block keeps its name and its K/V until the allocator needs the memory: free blocks queue in
least-recently-used order, and a request that starts with a cached prefix takes those blocks
instead of recomputing them. Full blocks are never written again, so sharing them is safe.

Requests admitted into the same step share too: a full block that a request admitted earlier in
the step will compute in it (`plan_computed`) is matched like a cached one by a later request
with the same prefix, which then computes only what follows. This is safe because every layer
writes the whole step's K/V into the cache before any token attends (model/attention.py,
csrc/decoder_stack.cpp). Without it, a burst of requests sharing a system prompt computes the
prompt once per request in the step that admits them; with it, once per step, as vLLM's KV
cache manager does by naming blocks when it allocates them. The blocks are named (and their
KV events published) only after the step has computed them, as every block is.

One manager keeps one KV-cache group: the layers whose caches share its block ids. A model
whose layers all attend to the whole context has one group; so has one whose layers all have a
sliding window (`window`: Mistral's). A model with both (Gemma 3's five local layers per global
one) has two, kept together by `KVCacheManager` (kv_cache_manager.py): the full layers' and the
windowed layers', each with its own pool and its own table per request
(`Request.kv_groups[group]`). A windowed group hands back each request's blocks once they fall
behind the window of every query still to come (`cache_computed_blocks`), so a long
sequence holds only about a window's worth of them; handed-back blocks keep their names, and
a prefix hit there needs only the blocks of the window before the hit's end
(`cached_blocks`), the leading table entries pointing at the group's null block (block 0,
never allocated), which the attention kernel never reads.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from rankcast.channel.events import KVBlocksRemoved, KVBlocksStored, KVCacheCleared, KVCacheEvent
from rankcast.channel.kv_index import block_hash
from rankcast.engine_core.request import GroupBlocks, Request

# A windowed group's placeholder for table entries of blocks it does not hold (behind the
# window): never allocated, never read.
NULL_BLOCK = 0


@dataclass
class Block:
    ref_count: int = 0
    block_hash: int | None = None


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        kv_events: bool = False,
        window: int = 0,
        group: int = 0,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # The group's sliding window (0: its layers attend to the whole context), and which of
        # a request's `kv_groups` is this group's.
        self.window = window
        self.group = group
        self.blocks = [Block() for _ in range(num_blocks)]
        # Free blocks, least recently used first: allocation takes from the front. A windowed
        # group keeps block 0 aside as its null block.
        first = 1 if window else 0
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(first, num_blocks))
        self.usable_blocks = num_blocks - first
        self.cached: dict[int, int] = {}  # block hash -> block id
        # Full blocks that requests admitted into the step being formed compute in it:
        # block hash -> block id, matched after `cached` (cleared as each step is formed).
        self.planned: dict[int, int] = {}
        # Prompt tokens looked up in the cache, and found, since start (what routers chart).
        self.queried_tokens = 0
        self.hit_tokens = 0
        # With KV-cache events on: names dropped and blocks named since the last take, in order.
        # The first event of every engine incarnation says the cache is empty, so a subscriber
        # that indexed an earlier incarnation drops what it held (its blocks are gone).
        self.kv_events = kv_events and enable_prefix_caching
        self._removed: list[int] = []
        self._events: list[KVCacheEvent] = [KVCacheCleared()] if self.kv_events else []

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _table(self, request: Request) -> GroupBlocks:
        while len(request.kv_groups) <= self.group:
            request.kv_groups.append(GroupBlocks())
        return request.kv_groups[self.group]

    def _missing(self, request: Request, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(self._table(request).block_ids))

    def can_allocate(self, request: Request, num_tokens: int) -> bool:
        """Whether the request can hold K/V for its first `num_tokens` tokens."""
        return self._missing(request, num_tokens) <= len(self.free_blocks)

    def allocate(self, request: Request, num_tokens: int) -> None:
        """Give the request the blocks for its first `num_tokens` tokens (caller checked),
        reusing the least recently used free blocks; a reused block loses its cached name."""
        for _ in range(self._missing(request, num_tokens)):
            block_id, _ = self.free_blocks.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) == block_id:
                    del self.cached[block.block_hash]
                    if self.kv_events:
                        self._removed.append(block.block_hash)
                block.block_hash = None
            block.ref_count = 1
            self._table(request).block_ids.append(block_id)

    def free(self, request: Request) -> None:
        """Release the request's blocks; its last blocks become the first to be reused, so a
        shared prefix outlives the tails that followed it."""
        table = self._table(request)
        for block_id in reversed(table.block_ids[table.num_released :]):
            self._release(block_id)
        request.kv_groups[self.group] = GroupBlocks()

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_blocks[block_id] = None

    def _hashes(self, request: Request, full_blocks: int) -> list[int]:
        """The request's block names for its first `full_blocks` blocks, computed once."""
        hashes = request.block_hashes
        bs = self.block_size
        while len(hashes) < full_blocks:
            i = len(hashes)
            tokens = request.token_slice(i * bs, bs)
            hashes.append(block_hash(hashes[-1] if hashes else None, tokens, request.lora_id))
        return hashes[:full_blocks]

    def begin_step(self) -> None:
        """A new step is being formed: blocks planned for the last one are computed (and
        named) by now, or were never computed."""
        self.planned.clear()

    def plan_computed(self, request: Request, num_tokens: int) -> None:
        """The request (its blocks allocated) computes its tokens up to `num_tokens` in the step
        being formed: a later request of the step may share its full blocks not yet named."""
        if not self.enable_prefix_caching:
            return
        full = num_tokens // self.block_size
        hashes = self._hashes(request, full)
        table = self._table(request).block_ids
        for i in range(request.num_computed_tokens // self.block_size, full):
            if hashes[i] not in self.cached and hashes[i] not in self.planned:
                self.planned[hashes[i]] = table[i]

    def _lookup(self, name: int) -> int | None:
        """The block holding `name`: cached, or computed in this step by a request admitted
        before (held by the request computing it)."""
        block_id = self.cached.get(name)
        return block_id if block_id is not None else self.planned.get(name)

    def first_needed_block(self, num_tokens: int) -> int:
        """The first block a query at position `num_tokens` still reads (0 without a window:
        it sees keys from num_tokens - window + 1 on)."""
        if not self.window:
            return 0
        return max(0, num_tokens - self.window + 1) // self.block_size

    def hit_possible(self, request: Request, blocks: int) -> bool:
        """Whether this group could start the request after its first `blocks` full blocks:
        it holds every block a query there reads."""
        hashes = self._hashes(request, blocks)
        first = self.first_needed_block(blocks * self.block_size)
        return all(self._lookup(name) is not None for name in hashes[first:blocks])

    def cached_blocks(self, request: Request) -> int:
        """The longest prefix (in full blocks, never the request's last token: that one is
        computed, to sample from) this group could start the request after. Without a window,
        the longest run of cached leading blocks; with one, the furthest point whose window's
        blocks are all cached."""
        if not self.enable_prefix_caching or self._table(request).block_ids:
            return 0
        limit = (request.num_tokens - 1) // self.block_size
        hashes = self._hashes(request, limit)
        run = 0
        while run < limit and self._lookup(hashes[run]) is not None:
            run += 1
        if not self.window:
            return run
        for blocks in range(limit, run, -1):
            if self.hit_possible(request, blocks):
                return blocks
        return run

    def take_prefix(self, request: Request, blocks: int) -> None:
        """Give a request that holds no blocks its first `blocks` full blocks from the cache
        (`cached_blocks` or `hit_possible` said this group has them); the entries before the
        window are the null block."""
        table = self._table(request)
        first = self.first_needed_block(blocks * self.block_size)
        table.block_ids = [NULL_BLOCK] * first
        for name in self._hashes(request, blocks)[first:]:
            block_id = self._lookup(name)
            assert block_id is not None, "take_prefix: a block the group does not hold"
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
            table.block_ids.append(block_id)
        table.num_cached_blocks = blocks
        table.num_released = first

    def match_prefix(self, request: Request) -> int:
        """Give a request that holds no blocks the longest cached prefix of its full blocks
        (`cached_blocks`), cached or computed in this step by a request admitted before it.
        Returns the tokens found; the request counts them as computed."""
        blocks = self.cached_blocks(request)
        if not blocks:
            return 0
        self.take_prefix(request, blocks)
        request.num_computed_tokens = blocks * self.block_size
        return request.num_computed_tokens

    def record_lookup(self, queried: int, hit: int) -> None:
        self.queried_tokens += queried
        self.hit_tokens += hit

    def cache_computed_blocks(self, request: Request) -> None:
        """After a step computed the request's tokens: name its blocks that have become full of
        computed tokens, so that later requests find them (a block another request named first
        stays unnamed); then, in a windowed group, hand back the blocks behind the window of
        every query still to come (they keep their names)."""
        if self.enable_prefix_caching:
            self._name_full_blocks(request)
        if self.window:
            table = self._table(request)
            first = min(self.first_needed_block(request.num_computed_tokens), len(table.block_ids))
            for i in range(table.num_released, first):
                self._release(table.block_ids[i])
                table.block_ids[i] = NULL_BLOCK
            table.num_released = max(table.num_released, first)

    def _name_full_blocks(self, request: Request) -> None:
        table = self._table(request)
        full = request.num_computed_tokens // self.block_size
        if full <= table.num_cached_blocks:
            return
        hashes = self._hashes(request, full)
        named: list[int] = []  # blocks of this request named now (a run; flushed on a gap)
        for i in range(table.num_cached_blocks, full):
            block_id = table.block_ids[i]
            if hashes[i] not in self.cached:
                self.cached[hashes[i]] = block_id
                self.blocks[block_id].block_hash = hashes[i]
                named.append(i)
            elif named:
                self._stored(request, hashes, named)
                named = []
        if named:
            self._stored(request, hashes, named)
        table.num_cached_blocks = full

    def _stored(self, request: Request, hashes: list[int], run: list[int]) -> None:
        if not self.kv_events:
            return
        first, bs = run[0], self.block_size
        self._events.append(
            KVBlocksStored(
                block_hashes=[hashes[i] for i in run],
                parent_block_hash=hashes[first - 1] if first else None,
                token_ids=request.token_slice(first * bs, len(run) * bs),
                block_size=bs,
                lora_id=request.lora_id,
                lora_name=request.lora_name,
                group_idx=self.group,
            )
        )

    def take_kv_events(self) -> list[KVCacheEvent]:
        """This step's cache changes, removals first (a step evicts while it schedules and
        names blocks after it ran), then each run of newly named blocks."""
        events: list[KVCacheEvent] = []
        if self._removed:
            events.append(KVBlocksRemoved(block_hashes=self._removed, group_idx=self.group))
            self._removed = []
        events += self._events
        self._events = []
        return events

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; only while no request holds a block (False otherwise),
        so no running request loses a name it is about to publish."""
        if len(self.free_blocks) != self.usable_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        self.planned.clear()
        self._removed = []
        self._events = [KVCacheCleared()] if self.kv_events else []
        return True

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, 0..1, as routers read `kv_cache_usage_perc`
        (cached blocks no request holds count as free: they are reused on demand)."""
        used = self.usable_blocks - len(self.free_blocks)
        return used / self.usable_blocks if self.usable_blocks else 0.0
