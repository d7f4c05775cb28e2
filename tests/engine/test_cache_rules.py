"""Rules of the prefix cache that equal outputs alone did not guard (issue 35): each was broken
by a one-line change that every earlier test survived. Each test here fails when its rule
breaks; tests/mutation/mutants.py holds the one-line change for each."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rankcast import LLM, SamplingParams
from rankcast.channel.events import KVBlocksStored
from rankcast.channel.kv_index import block_hash
from rankcast.config import SchedulerConfig
from rankcast.engine_core.block_manager import BlockManager
from rankcast.engine_core.scheduler import Scheduler
from rankcast.protocol import ModelRunnerOutput
from tests.engine.test_scheduler import _prompt_request, _run

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
BLOCK = 16  # the engine's default block size


def _finish(scheduler: Scheduler, rid: str, steps: int = 50) -> None:
    """Step until `rid` finishes; fail, instead of hanging, if it does not within `steps`, or
    if a step schedules a sequence with nothing to compute."""
    for _ in range(steps):
        if rid not in scheduler.requests:
            return
        batch = scheduler.schedule()
        assert all(s.token_ids for s in batch.sequences), "a sequence with nothing to compute"
        ids = [s.request_id for s in batch.sequences if s.sample]
        scheduler.update_from_output(ModelRunnerOutput(ids, [[7]] * len(ids)))
    raise AssertionError(f"{rid} did not finish in {steps} steps")


def _check_allocator(scheduler: Scheduler) -> None:
    """The allocator's own invariant: a block is free exactly when no request holds it, and
    held as many times as requests hold it."""
    blocks = scheduler.blocks
    holders: dict[int, int] = {}
    for request in scheduler.requests.values():
        for block_id in request.block_ids:
            holders[block_id] = holders.get(block_id, 0) + 1
    for block_id, block in enumerate(blocks.blocks):
        assert block.ref_count == holders.get(block_id, 0), f"block {block_id}"
        assert (block_id in blocks.free_blocks) == (block.ref_count == 0), f"block {block_id}"


def _generate_stepwise(llm: LLM, prompts: list[list[int]], deadline_s: float = 60) -> list:
    """All prompts at once through the offline engine, step by step, the allocator checked
    after every step; each prompt's tokens, in order."""
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    tokens: dict[str, list[int]] = {}
    deadline = time.monotonic() + deadline_s
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine stopped making progress"
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = list(output.outputs[0].token_ids)
        _check_allocator(engine.client.core.scheduler)
    return [tokens[i] for i in ids]


def _llm(model_dir: Path, caching: bool, **kwargs: object) -> LLM:
    options = {"dtype": "float32", "enable_prefix_caching": caching, **kwargs}
    return LLM(str(model_dir), **options)  # type: ignore[arg-type]


# ---- a prefix-cache hit never covers a prompt's last token ----


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    blocks = BlockManager(32, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4), blocks, 1024)
    prompt = list(range(700, 708))  # exactly two full blocks
    scheduler.add_request(_prompt_request("first", prompt))
    _finish(scheduler, "first")
    scheduler.add_request(_prompt_request("again", prompt))
    seq = scheduler.schedule().sequences[0]
    assert seq.sample and seq.token_ids and seq.start_position + len(seq.token_ids) == 8
    assert seq.start_position == 4, "the first block is reused, the last one computed again"
    _finish(scheduler, "again")


def test_a_prompt_sent_again_whole_completes_with_the_same_text(tiny_llama_dir: Path) -> None:
    prompt = [(5 * j) % 200 + 3 for j in range(2 * BLOCK)]  # a multiple of the block size
    with _llm(tiny_llama_dir, True, kv_cache_space_gib=0.05) as llm:
        first = _generate_stepwise(llm, [prompt])
        again = _generate_stepwise(llm, [prompt])
        assert llm.engine.client.core.scheduler.blocks.hit_tokens == BLOCK
    assert first == again and len(first[0]) == GREEDY.max_tokens


# ---- a block's cache identity chains its parent's ----


def test_the_same_block_after_another_prefix_is_another_block() -> None:
    blocks = BlockManager(32, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4), blocks, 1024)
    before, shared = list(range(800, 804)), list(range(900, 904))
    scheduler.add_request(_prompt_request("first", [*before, *shared, 1]))
    _finish(scheduler, "first")
    # `shared` was the second block of "first": K/V computed after `before`, at positions 4-7.
    scheduler.add_request(_prompt_request("second", [*shared, 2]))
    assert scheduler.schedule().sequences[0].start_position == 0, "reused K/V of another context"
    assert block_hash(None, shared, 0) != block_hash(block_hash(None, before, 0), shared, 0)


def test_prompts_sharing_later_blocks_but_not_earlier_ones_generate_as_without_the_cache(
    tiny_llama_dir: Path,
) -> None:
    a, b, c = ([(k * j + 7) % 230 + 3 for j in range(BLOCK)] for k in (3, 5, 11))
    prompts = [[*a, *c, 1, 2], [*b, *c, 3], [*c, 4, 5], [*c, *a, 6]]
    outputs = []
    for caching in (False, True):
        with _llm(tiny_llama_dir, caching, kv_cache_space_gib=0.05) as llm:
            outputs.append([_generate_stepwise(llm, [p])[0] for p in prompts])  # one at a time
    assert outputs[0] == outputs[1]


# ---- a cached block a request reuses leaves the free queue while held ----


def test_a_reused_cached_block_is_never_handed_to_another_request() -> None:
    blocks = BlockManager(6, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4), blocks, 1024)
    prompt = list(range(600, 609))  # two full blocks and one token
    scheduler.add_request(_prompt_request("a", prompt))
    _finish(scheduler, "a")
    scheduler.add_request(_prompt_request("b", prompt))
    _run(scheduler)
    reused = scheduler.requests["b"].block_ids[:2]
    assert blocks.hit_tokens == 8 and all(i not in blocks.free_blocks for i in reused)
    _check_allocator(scheduler)
    # Another request takes every block still free: none of them may be one "b" holds.
    scheduler.add_request(_prompt_request("c", list(range(1000, 1011))))
    _run(scheduler)
    assert not set(scheduler.requests["c"].block_ids) & set(scheduler.requests["b"].block_ids)
    _check_allocator(scheduler)


def test_under_memory_pressure_with_repeats_and_preemptions_outputs_match_no_cache(
    tiny_llama_dir: Path,
) -> None:
    system = [(13 * j) % 230 + 3 for j in range(2 * BLOCK)]
    prompts = [[*system, i, i + 1, i + 2] for i in range(6)] * 2 + [system[: BLOCK + 3]] * 2
    outputs = []
    for caching in (False, True):
        # 12 blocks of 16 for up to 4 sequences of ~3 blocks: requests are preempted.
        with _llm(tiny_llama_dir, caching, num_blocks=12, max_num_seqs=4) as llm:
            outputs.append(_generate_stepwise(llm, prompts))
            stats = llm.engine.client.core.scheduler.stats()
            if caching:
                assert stats.prefix_cache_hits > 0
    assert outputs[0] == outputs[1]


# ---- a kv_blocks_stored event names as parent the block just before its first block ----


def test_a_subscriber_rebuilds_the_engines_block_names_from_parents_and_tokens(
    tiny_llama_dir: Path,
) -> None:
    prompt = [(7 * j) % 230 + 3 for j in range(5 * BLOCK + 3)]
    # A step computes one block of the prompt: several stored events for the one request.
    with _llm(
        tiny_llama_dir,
        True,
        kv_cache_space_gib=0.05,
        kv_events=True,
        max_num_batched_tokens=BLOCK,
        max_num_seqs=4,
    ) as llm:
        llm.take_notifications()
        llm.generate([prompt], GREEDY)
        stored = [n for n in llm.take_notifications() if isinstance(n, KVBlocksStored)]
        cached = set(llm.engine.client.core.scheduler.blocks.cached)
    assert len(stored) >= 3 and any(n.parent_block_hash is not None for n in stored)
    rebuilt = []
    for event in stored:
        name = event.parent_block_hash
        for i, expected in enumerate(event.block_hashes):
            tokens = event.token_ids[i * event.block_size : (i + 1) * event.block_size]
            name = block_hash(name, tokens, event.lora_id)
            assert name == expected, "the chain from the event's parent reaches another name"
            rebuilt.append(name)
    assert set(rebuilt) <= cached and len(rebuilt) >= 5


# ---- requests admitted into one step share the full blocks the step computes ----


def test_requests_admitted_together_compute_their_shared_prefix_once() -> None:
    blocks = BlockManager(32, 4, kv_events=True)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4), blocks, 1024)
    shared = list(range(500, 508))  # two full blocks
    for rid, tail in (("first", [1, 2]), ("second", [3]), ("other", [9])):
        prompt = [*shared, *tail] if rid != "other" else [600, *shared[1:], *tail]
        scheduler.add_request(_prompt_request(rid, prompt))
    blocks.take_kv_events()
    first, second, other = scheduler.schedule().sequences
    assert (first.start_position, second.start_position, other.start_position) == (0, 8, 0)
    assert second.block_ids[:2] == first.block_ids[:2], "the blocks the first one computes"
    assert not set(other.block_ids) & set(first.block_ids), "another first token, other blocks"
    assert blocks.hit_tokens == 8
    _check_allocator(scheduler)
    ids = [s.request_id for s in (first, second, other)]
    scheduler.update_from_output(ModelRunnerOutput(ids, [[7]] * 3))
    stored = [e for e in blocks.take_kv_events() if isinstance(e, KVBlocksStored)]
    named = [h for e in stored for h in e.block_hashes]
    assert len(named) == len(set(named)) == 4, "each computed block named once, by its writer"
    for rid in ids:
        _finish(scheduler, rid)
    _check_allocator(scheduler)


def test_a_chunk_shares_only_the_blocks_it_completes_in_the_step() -> None:
    blocks = BlockManager(32, 4)
    writer = _prompt_request("writer", list(range(300, 313)))  # 13 tokens: blocks 0-2 full
    reader = _prompt_request("reader", list(range(300, 313)))
    blocks.match_prefix(writer)
    blocks.allocate(writer, 10)
    blocks.plan_computed(writer, 10)  # this step computes tokens 0-9: blocks 0 and 1 whole
    assert blocks.match_prefix(reader) == 8, "block 2 is only half written in this step"
    assert reader.block_ids == writer.block_ids[:2]
    blocks.free(reader)
    blocks.begin_step()  # the next step: what was planned is named by now, or never computed
    assert blocks.match_prefix(reader) == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prompts_admitted_together_generate_as_without_the_cache(
    tiny_llama_dir: Path, dtype: str
) -> None:
    system = [(17 * j) % 230 + 3 for j in range(2 * BLOCK + 5)]
    prompts = [[*system, i + 4, 2 * i + 9] for i in range(4)]
    outputs = []
    for caching in (False, True):
        options = {"kv_cache_space_gib": 0.05, "max_num_seqs": 8, "dtype": dtype}
        with _llm(tiny_llama_dir, caching, **options) as llm:
            outputs.append(_generate_stepwise(llm, prompts))  # all four in the first step
            hits = llm.engine.client.core.scheduler.blocks.hit_tokens
            assert hits == (3 * 2 * BLOCK if caching else 0), "three share the first's blocks"
    assert outputs[0] == outputs[1]


def test_what_a_step_planned_is_forgotten_once_its_blocks_can_be_reused() -> None:
    """A block planned in one step is named when computed; once its memory goes to another
    request the name is dropped, and an old plan must not bring it back."""
    blocks = BlockManager(4, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4), blocks, 1024)
    prompt = list(range(700, 709))  # two full blocks and one token
    scheduler.add_request(_prompt_request("first", prompt))
    _finish(scheduler, "first")
    scheduler.add_request(_prompt_request("filler", list(range(900, 913))))  # every block
    _finish(scheduler, "filler")
    first_block = block_hash(None, prompt[:4], 0)
    names = [first_block, block_hash(first_block, prompt[4:8], 0)]
    assert not any(name in blocks.cached for name in names), "the filler took their memory"
    scheduler.add_request(_prompt_request("again", prompt))
    assert scheduler.schedule().sequences[0].start_position == 0, "K/V of another request"
    _check_allocator(scheduler)
