"""Block naming and an engine's prefix-cache index rebuilt from its KV-cache events: what a
router keeps. A leaf module: the engine core names blocks and keeps an index for its snapshot
with it, and every API server keeps one per engine to route by.

The engine core keeps one too, built from the events as they leave it, so the catch-up snapshot
carries exactly the state the stream has described up to the snapshot's `engine_seq`: a late
subscriber starts from it and applies what follows, with no replay from the start.

A router scores a request by walking the request's blocks with `block_hash` (the engine's own
naming, documented and stable) until a name is missing: that many leading tokens are cached.
"""

from __future__ import annotations

import hashlib
from collections.abc import Container, Iterator
from dataclasses import dataclass

import msgspec

from rankcast.channel.events import KVBlocksRemoved, KVBlocksStored, KVCacheCleared, Notification
from rankcast.channel.snapshot import KVCacheBlock, KVCacheState

_HASH_MASK = (1 << 63) - 1  # non-negative 64-bit: every msgpack peer reads it as an integer


def block_hash(parent: int | None, token_ids: list[int], adapter_id: int) -> int:
    """The name of a full block: stable across processes and runs, so that KV-cache events
    mean the same thing to every subscriber."""
    data = msgspec.msgpack.encode((parent, token_ids, adapter_id))
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & _HASH_MASK


def block_names(token_ids: list[int], block_size: int, lora_id: int = 0) -> Iterator[int]:
    """The names of a prompt's full blocks, in order (each chained to the one before)."""
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size], lora_id)
        yield parent


@dataclass(frozen=True)
class IndexedBlock:
    parent: int | None
    token_ids: tuple[int, ...]
    lora_id: int


class KVCacheIndex:
    def __init__(self) -> None:
        self.blocks: dict[int, IndexedBlock] = {}
        # Blocks that start a sequence (no parent): how many distinct prefixes are held.
        self.roots = 0

    def apply(self, n: Notification) -> None:
        """Apply one event (other notification types are ignored, and so are the blocks of a
        sliding-window KV-cache group, `group_idx` 1: a prefix is matched on the full group's
        blocks, which the index mirrors)."""
        if isinstance(n, (KVBlocksStored, KVBlocksRemoved)) and n.group_idx != 0:
            return
        if isinstance(n, KVBlocksStored):
            bs = n.block_size
            for i, name in enumerate(n.block_hashes):
                parent = n.parent_block_hash if i == 0 else n.block_hashes[i - 1]
                tokens = tuple(n.token_ids[i * bs : (i + 1) * bs])
                # A block stored again replaces what was held: a root counts once, as held now.
                old = self.blocks.get(name)
                self.roots += int(parent is None) - int(old is not None and old.parent is None)
                self.blocks[name] = IndexedBlock(parent, tokens, n.lora_id)
        elif isinstance(n, KVBlocksRemoved):
            for name in n.block_hashes:
                gone = self.blocks.pop(name, None)
                if gone is not None and gone.parent is None:
                    self.roots -= 1
        elif isinstance(n, KVCacheCleared):
            self.blocks.clear()
            self.roots = 0

    def cached_prefix(
        self,
        token_ids: list[int],
        block_size: int,
        lora_id: int = 0,
        also: Container[int] = (),
    ) -> int:
        """How many leading tokens of a prompt the engine holds (whole blocks); a name in
        `also` counts as held too (a router's blocks expected soon)."""
        found = 0
        for name in block_names(token_ids, block_size, lora_id):
            if name not in self.blocks and name not in also:
                break
            found += block_size
        return found

    def state(self, block_size: int) -> KVCacheState:
        """The snapshot section: every block, in name order."""
        return KVCacheState(
            block_size,
            [
                KVCacheBlock(name, b.parent, list(b.token_ids), b.lora_id)
                for name, b in sorted(self.blocks.items())
            ],
        )

    @classmethod
    def from_state(cls, state: KVCacheState) -> KVCacheIndex:
        index = cls()
        for block in state.blocks:
            index.blocks[block.block_hash] = IndexedBlock(
                block.parent, tuple(block.token_ids), block.lora_id
            )
            index.roots += int(block.parent is None)
        return index
