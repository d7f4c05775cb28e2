"""The KV cache of models with sliding-window layers (engine_core/kv_cache_manager.py,
block_manager.py): a windowed group hands back the blocks behind its window, so a long
sequence holds about a window's worth of them; its prefix hits need only the window's blocks;
with full-attention layers as well (Gemma 3), the two groups' pools are sized apart and a hit
holds for both. Scheduler-level with plain token ids, then the engine on a tiny Gemma 3."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from rankcast import LLM, SamplingParams
from rankcast.config import SchedulerConfig
from rankcast.engine_core.block_manager import NULL_BLOCK, BlockManager
from rankcast.engine_core.kv_cache_manager import (
    KVCacheManager,
    KVCacheSplit,
    split_cache,
    window_pool_cap,
)
from rankcast.engine_core.scheduler import Scheduler
from rankcast.model_files.arch import ArchConfig
from tests.engine.test_cache_rules import _finish
from tests.engine.test_scheduler import _prompt_request, _run

BLOCK, WINDOW = 4, 10


def _window_held(request_blocks: list[int]) -> int:
    return sum(1 for block in request_blocks if block != NULL_BLOCK)


def _hybrid(full_blocks: int = 64, window_blocks: int = 24) -> KVCacheManager:
    return KVCacheManager(
        BlockManager(full_blocks, BLOCK),
        BlockManager(window_blocks, BLOCK, window=WINDOW, group=1),
    )


def test_a_windowed_group_holds_only_the_window_of_a_long_sequence() -> None:
    """40 prompt tokens then 30 generated, window 10, blocks of 4: the windowed group never
    holds more than the blocks a window spans plus the one being filled, the full group every
    block; what it handed back is free again, and the table's entries for it are the null
    block."""
    blocks = _hybrid()
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4), blocks, 1024)
    request = _prompt_request("long", list(range(100, 140)))
    request.max_tokens = 30
    scheduler.add_request(request)
    bound = math.ceil((WINDOW - 1) / BLOCK) + 2
    peak = 0
    for _ in range(100):  # 40 + 30 tokens take 31 steps: never loop forever
        _run(scheduler)
        if "long" not in scheduler.requests:
            break
        window_table = request.kv_groups[1].block_ids
        held = _window_held(window_table)
        peak = max(peak, held)
        assert held <= bound, (held, window_table)
        first = blocks.windowed.first_needed_block(request.num_computed_tokens)
        assert all(b == NULL_BLOCK for b in window_table[:first])
        assert len(blocks.windowed.free_blocks) == blocks.windowed.usable_blocks - held
        full = math.ceil(request.num_computed_tokens / BLOCK)
        assert len(request.block_ids) >= full
    else:
        raise AssertionError("the request did not finish")
    assert peak >= 2
    # Finished: every block of both groups is free again.
    assert len(blocks.windowed.free_blocks) == blocks.windowed.usable_blocks
    assert len(blocks.full.free_blocks) == blocks.full.usable_blocks


def test_a_windowed_prefix_hit_needs_only_the_blocks_of_the_window() -> None:
    """Mistral's case, one windowed group: a second request repeating a finished one's prompt
    starts after its full blocks even though the first one's early blocks were handed back
    and taken by others; the entries behind the window are the null block."""
    blocks = BlockManager(12, BLOCK, window=WINDOW)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4), blocks, 1024)
    prompt = list(range(200, 233))  # 8 full blocks and one token
    first = _prompt_request("first", prompt)
    scheduler.add_request(first)
    _finish(scheduler, "first")
    # Another request reuses the blocks the first one handed back (least recently used).
    filler = _prompt_request("filler", list(range(500, 512)))
    scheduler.add_request(filler)
    _run(scheduler)
    assert first.block_hashes[0] not in blocks.cached  # its first block's name is gone
    again = _prompt_request("again", prompt)
    scheduler.add_request(again)
    hits = blocks.hit_tokens
    _run(scheduler)
    assert blocks.hit_tokens - hits == 32  # 8 blocks; only the last token computed
    assert again.num_computed_tokens == 33
    table = again.kv_groups[0].block_ids
    behind = blocks.first_needed_block(again.num_computed_tokens)
    assert behind > 0 and table[:behind] == [NULL_BLOCK] * behind
    assert NULL_BLOCK not in table[behind:]


def test_a_hybrid_hit_stops_where_the_windowed_group_lost_its_window() -> None:
    """Both groups must hold a hit: the full group every block up to its end, the windowed
    group the window before it. With the windowed group's blocks gone (its pool reused), the
    hit shrinks to nothing although the full group still has every block."""
    blocks = _hybrid(full_blocks=64, window_blocks=12)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4), blocks, 1024)
    prompt = list(range(300, 333))
    first = _prompt_request("first", prompt)
    scheduler.add_request(first)
    _finish(scheduler, "first")
    assert blocks.full.cached_blocks(_prompt_request("probe", prompt)) == 8
    # Both groups still have it: the whole run is a hit.
    probe = _prompt_request("probe", prompt)
    assert blocks.windowed.hit_possible(probe, 8)
    # Another prompt takes (nearly) every block of the windowed pool: the names are gone there.
    other = _prompt_request("other", list(range(600, 640)))
    scheduler.add_request(other)
    _finish(scheduler, "other")
    assert blocks.full.cached_blocks(_prompt_request("probe", prompt)) == 8
    assert not blocks.windowed.hit_possible(_prompt_request("probe", prompt), 8)
    again = _prompt_request("again", prompt)
    scheduler.add_request(again)
    hits = blocks.hit_tokens
    _run(scheduler)
    assert blocks.hit_tokens - hits < 32


def test_both_groups_publish_their_blocks_each_saying_its_group() -> None:
    """With KV events on, the full group's blocks and the windowed group's are published, each
    event with its `group_idx`; an incarnation's opening `KVCacheCleared` comes once; in vLLM's
    format group 0 leaves the field out and group 1 says 1; the engine view's prefix index
    holds the full group's blocks only."""
    import msgspec

    from rankcast.channel.events import KVBlocksRemoved, KVBlocksStored, KVCacheCleared
    from rankcast.channel.kv_index import KVCacheIndex
    from rankcast.channel.vllm_kv_events import to_vllm

    blocks = KVCacheManager(
        BlockManager(64, BLOCK, kv_events=True),
        BlockManager(12, BLOCK, kv_events=True, window=WINDOW, group=1),
    )
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4), blocks, 1024)
    scheduler.add_request(_prompt_request("first", list(range(100, 133))))
    _finish(scheduler, "first")
    scheduler.add_request(_prompt_request("other", list(range(600, 640))))  # evicts group 1
    _finish(scheduler, "other")
    events = blocks.take_kv_events()
    assert sum(isinstance(e, KVCacheCleared) for e in events) == 1
    stored = [e for e in events if isinstance(e, KVBlocksStored)]
    removed = [e for e in events if isinstance(e, KVBlocksRemoved)]
    assert {e.group_idx for e in stored} == {0, 1}
    assert removed and {e.group_idx for e in removed} == {1}  # only the small pool ran out
    index = KVCacheIndex()
    for event in events:
        index.apply(event)
    full_names = {h for e in stored if e.group_idx == 0 for h in e.block_hashes}
    assert set(index.blocks) == full_names
    for event in stored[:1] + [e for e in stored if e.group_idx == 1][:1]:
        encoded = msgspec.json.decode(msgspec.json.encode(to_vllm(event)))
        assert encoded.get("group_idx") == (event.group_idx or None)


def test_the_pools_are_sized_for_the_window_and_every_rank() -> None:
    """The windowed pool is as large as the full one until the window's needs are met (then
    capped); the full pool takes every byte left; the tightest rank decides; a rank with
    only full layers (a pipeline stage) constrains only the full pool."""
    cap = window_pool_cap(window=512, block_size=16, max_num_seqs=4, step_tokens=512)
    assert cap == 4 * (math.ceil(511 / 16) + 2) + 32 + 1
    # One rank, 5 window layers to 1 full: bytes per block 5 units and 1 unit.
    roomy = split_cache([(1_000_000, 1, 5)], cap)
    assert roomy.window_blocks == cap
    assert roomy.full_blocks == 1_000_000 - cap * 5
    tight = split_cache([(600, 1, 5)], cap)
    assert tight.window_blocks == tight.full_blocks == 100
    ranks = split_cache([(1_000_000, 1, 5), (10_000, 2, 0)], cap)
    assert ranks == KVCacheSplit(5_000, cap)
    assert split_cache([(1000, 10, 0)], cap) == KVCacheSplit(100, 0)


# ---- the engine, on a tiny Gemma 3 ----


@pytest.fixture(scope="module")
def gemma3_long(tmp_path_factory: pytest.TempPathFactory, tokenizer_source: Path) -> Path:
    from tests.model.family_models import write_checkpoint

    return write_checkpoint(
        tmp_path_factory.mktemp("gemma3-long"),
        "gemma3",
        tokenizer_source,
        seed=6,
        num_hidden_layers=3,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=24,
        max_position_embeddings=4096,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    )


def test_gemma3s_local_layers_hold_a_window_of_a_long_chat(gemma3_long: Path) -> None:
    """A 700-token prompt and 40 new tokens, greedy: the same tokens as transformers; the local
    layers' pool is the window's size (far below the full layers'), and at no step did the
    request hold more of it than its window spans."""
    import torch
    import transformers

    arch = ArchConfig.from_model_dir(gemma3_long)
    assert arch.separate_window_group and arch.group_windows() == (0, 24)
    prompt = [(29 * j) % 5000 + 300 for j in range(700)]
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(gemma3_long), dtype=torch.float32
    )
    with torch.no_grad():
        want = reference.generate(
            torch.tensor([prompt]), max_new_tokens=40, do_sample=False, min_new_tokens=40
        )[0, len(prompt) :].tolist()
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with LLM(str(gemma3_long), dtype="float32", kv_cache_space_gib=0.05, max_num_seqs=4) as llm:
        blocks = llm.engine.client.core.scheduler.blocks
        assert isinstance(blocks, KVCacheManager)
        assert blocks.windowed.num_blocks < blocks.full.num_blocks / 4
        engine = llm.engine
        engine.add_request(prompt, greedy)
        peak, got = 0, []
        deadline = time.monotonic() + 120
        while engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "the engine stopped making progress"
            for output in engine.step():
                got = list(output.outputs[0].token_ids)
            held = blocks.windowed.usable_blocks - len(blocks.windowed.free_blocks)
            peak = max(peak, held)
    assert got == want
    # The window (24) plus the step's new tokens: the prompt comes in chunks of at most
    # max_num_batched_tokens (512), whose K/V every layer writes before any token attends.
    assert peak <= math.ceil((23 + 512) / 16) + 2, peak
