"""KV-cache events: a subscriber that applies them holds exactly the engine's prefix-cache index,
through evictions, and the catch-up snapshot carries the same index."""

from __future__ import annotations

import random
from pathlib import Path

from rankcast import LLM, SamplingParams
from rankcast.channel.events import KVBlocksRemoved, KVBlocksStored, KVCacheCleared
from rankcast.channel.kv_index import KVCacheIndex

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def random_workload(seed: int, count: int) -> list[list[int]]:
    """Prompts built from a few shared bases (so prefixes repeat) with random tails."""
    rng = random.Random(seed)
    bases = [[rng.randrange(1, 250) for _ in range(rng.randrange(16, 60))] for _ in range(4)]
    return [
        rng.choice(bases) + [rng.randrange(1, 250) for _ in range(rng.randrange(1, 40))]
        for _ in range(count)
    ]


def test_the_event_stream_rebuilds_the_engines_index_through_evictions(
    tiny_llama_dir: Path,
) -> None:
    # 40 blocks of 16 tokens: far less than the workload touches, so blocks are evicted.
    with LLM(
        str(tiny_llama_dir),
        dtype="float32",
        num_blocks=40,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        kv_events=True,
    ) as llm:
        llm.take_notifications()
        index = KVCacheIndex()
        kinds: set[type] = set()
        prompts = random_workload(seed=1, count=30)
        for start in range(0, len(prompts), 3):
            llm.generate(prompts[start : start + 3], GREEDY)
            for n in llm.take_notifications():
                kinds.add(type(n))
                index.apply(n)
        blocks = llm.engine.client.core.scheduler.blocks
        assert {KVBlocksStored, KVBlocksRemoved} <= kinds, "the workload stored and evicted"
        assert set(index.blocks) == set(blocks.cached), "the stream describes the cache exactly"
        for name, block_id in blocks.cached.items():
            assert blocks.blocks[block_id].block_hash == name
        snapshot = llm.engine.client.core.snapshot().kv_cache
        assert snapshot is not None and snapshot.block_size == 16
        assert KVCacheIndex.from_state(snapshot).blocks == index.blocks
        # A router's view: the longest cached prefix of a prompt the engine has seen.
        last = prompts[-1]
        assert index.cached_prefix(last, 16) == 16 * (len(last) // 16)

        assert llm.reset_prefix_cache()
        cleared = llm.take_notifications()
        assert [type(n) for n in cleared] == [KVCacheCleared]
        index.apply(cleared[0])
        assert not index.blocks and not blocks.cached


def test_no_events_unless_asked(tiny_llama_dir: Path) -> None:
    with LLM(str(tiny_llama_dir), dtype="float32", kv_cache_space_gib=0.05) as llm:
        llm.generate(random_workload(seed=2, count=4), GREEDY)
        kv_types = (KVBlocksStored, KVBlocksRemoved, KVCacheCleared)
        assert not [n for n in llm.take_notifications() if isinstance(n, kv_types)]
        assert llm.engine.client.core.snapshot().kv_cache is None
