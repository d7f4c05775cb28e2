"""Continuous batching, admission control and preemption, without a model."""

from __future__ import annotations

from rankcast.config import SchedulerConfig
from rankcast.engine_core.block_manager import BlockManager
from rankcast.engine_core.request import Request, RequestStatus
from rankcast.engine_core.scheduler import Scheduler
from rankcast.protocol import ModelRunnerOutput
from rankcast.sampling_params import SamplingParams


def _request(rid: str, prompt_len: int, max_tokens: int = 100) -> Request:
    return Request(
        rid,
        list(range(prompt_len)),
        SamplingParams(temperature=0.0, max_tokens=max_tokens),
        max_tokens=max_tokens,
        eos_token_ids=frozenset({-1}),
    )


def _run(scheduler: Scheduler) -> list[str]:
    """One step with every sampling sequence given token 7; the ids that sampled."""
    batch = scheduler.schedule()
    ids = [s.request_id for s in batch.sequences if s.sample]
    scheduler.update_from_output(ModelRunnerOutput(ids, [[7]] * len(ids)))
    return ids


def test_requests_join_and_leave_a_running_batch() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8), BlockManager(64, 4), 1024)
    scheduler.add_request(_request("a", 5, max_tokens=3))
    scheduler.add_request(_request("b", 6, max_tokens=10))
    assert _run(scheduler) == ["a", "b"]
    assert _run(scheduler) == ["a", "b"]
    scheduler.add_request(_request("c", 3, max_tokens=10))
    batch = scheduler.schedule()
    assert [(s.request_id, len(s.token_ids)) for s in batch.sequences] == [
        ("a", 1),
        ("b", 1),
        ("c", 3),
    ], "a new prompt joins the running decodes in the same step"
    scheduler.update_from_output(ModelRunnerOutput(["a", "b", "c"], [[7], [7], [7]]))
    assert "a" not in scheduler.requests, "a finished at its third token and left the batch"
    assert _run(scheduler) == ["b", "c"]


def test_admission_waits_for_free_blocks_and_max_num_seqs() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2), BlockManager(6, 4), 1024)
    for rid in "abc":
        scheduler.add_request(_request(rid, 8))
    assert _run(scheduler) == ["a", "b"], "max_num_seqs caps the batch"
    assert scheduler.waiting[0].request_id == "c"
    assert scheduler.stats().num_waiting_reqs == 1 and scheduler.stats().num_running_reqs == 2


def test_full_cache_preempts_the_newest_and_recomputes_it_later() -> None:
    blocks = BlockManager(5, 4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8), blocks, 1024)
    scheduler.add_request(_request("old", 8))
    scheduler.add_request(_request("new", 8))
    _run(scheduler)  # both prefilled: 2 + 2 blocks, 1 free
    _run(scheduler)  # 9 tokens each: "old" takes the last free block, "new" must yield
    assert scheduler.num_preemptions == 1
    preempted = scheduler.waiting[0]
    assert preempted.request_id == "new" and preempted.status == RequestStatus.WAITING
    assert preempted.block_ids == [] and len(preempted.output_token_ids) == 1
    assert preempted.num_computed_tokens == 0
    # When "old" finishes, "new" is prefilled again with its prompt and generated tokens.
    scheduler.abort_requests(["old"])
    batch = scheduler.schedule()
    assert batch.sequences[0].token_ids == preempted.all_token_ids
    assert batch.sequences[0].start_position == 0 and batch.sequences[0].sample
    assert "old" in batch.finished_request_ids


def test_a_long_prompt_is_chunked_while_running_requests_keep_decoding() -> None:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8)
    scheduler = Scheduler(config, BlockManager(64, 4), 1024)
    scheduler.add_request(_request("a", 3))
    assert _run(scheduler) == ["a"]
    scheduler.add_request(_request("long", 20))
    steps = []
    for _ in range(3):
        batch = scheduler.schedule()
        steps.append(
            [(s.request_id, s.start_position, len(s.token_ids), s.sample) for s in batch.sequences]
        )
        ids = [s.request_id for s in batch.sequences if s.sample]
        scheduler.update_from_output(ModelRunnerOutput(ids, [[7]] * len(ids)))
    # "a" decodes every step; the prompt takes what is left of the 8-token budget each time.
    assert steps == [
        [("a", 3, 1, True), ("long", 0, 7, False)],
        [("a", 4, 1, True), ("long", 7, 7, False)],
        [("a", 5, 1, True), ("long", 14, 6, True)],
    ]
    long = scheduler.requests["long"]
    assert long.num_computed_tokens == 20 and long.output_token_ids == [7]
    assert len(long.block_ids) == 5, "blocks cover what was computed; the next step adds one"
    for step in steps[:2]:
        assert sum(n for _, _, n, _ in step) == 8, "the budget is used to the token"


def test_without_chunking_a_prompt_is_taken_whole_even_beyond_the_budget() -> None:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, enable_chunked_prefill=False)
    scheduler = Scheduler(config, BlockManager(64, 4), 1024)
    scheduler.add_request(_request("a", 3))
    _run(scheduler)
    scheduler.add_request(_request("long", 20))
    scheduler.add_request(_request("short", 4))
    batch = scheduler.schedule()
    assert [(s.request_id, len(s.token_ids)) for s in batch.sequences] == [("a", 1), ("long", 20)]
    assert scheduler.waiting[0].request_id == "short", "the next prompt waits for a later step"


def test_usage_is_a_fraction() -> None:
    blocks = BlockManager(10, 4)
    scheduler = Scheduler(SchedulerConfig(), blocks, 1024)
    scheduler.add_request(_request("a", 10))
    _run(scheduler)
    assert scheduler.stats().kv_cache_usage == 0.3


def _prompt_request(rid: str, tokens: list[int], lora_id: int = 0) -> Request:
    request = _request(rid, 0, max_tokens=4)
    request.prompt_token_ids = list(tokens)
    request.lora_id = lora_id
    return request


def _finish(scheduler: Scheduler, rid: str) -> None:
    while rid in scheduler.requests:
        _run(scheduler)


def test_a_shared_prefix_is_reused_and_only_the_rest_computed() -> None:
    blocks = BlockManager(32, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4), blocks, 1024)
    system = list(range(100, 112))  # three full blocks
    scheduler.add_request(_prompt_request("first", [*system, 1, 2]))
    _finish(scheduler, "first")
    scheduler.add_request(_prompt_request("second", [*system, 5, 6, 7]))
    batch = scheduler.schedule()
    seq = batch.sequences[0]
    assert (seq.start_position, seq.token_ids) == (12, [5, 6, 7]), "only the new suffix runs"
    assert seq.block_ids[:3] == scheduler.requests["second"].block_ids[:3]
    assert (blocks.queried_tokens, blocks.hit_tokens) == (14 + 15, 12)


def test_the_cache_never_mixes_adapters_or_positions() -> None:
    blocks = BlockManager(32, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4), blocks, 1024)
    prompt = list(range(200, 209))
    scheduler.add_request(_prompt_request("base", prompt))
    _finish(scheduler, "base")
    scheduler.add_request(_prompt_request("adapter", prompt, lora_id=3))
    assert scheduler.schedule().sequences[0].start_position == 0, "base K/V is not an adapter's"
    _finish(scheduler, "adapter")
    # The same tokens one position later are another prefix.
    scheduler.add_request(_prompt_request("shifted", [0, *prompt]))
    assert scheduler.schedule().sequences[0].start_position == 0


def test_freed_blocks_stay_cached_until_needed_least_recently_used_first() -> None:
    blocks = BlockManager(6, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4), blocks, 1024)
    old, recent = list(range(300, 309)), list(range(400, 409))
    for rid, prompt in (("old", old), ("recent", recent)):
        scheduler.add_request(_prompt_request(rid, prompt))
        _finish(scheduler, rid)
    assert blocks.usage == 0.0, "cached blocks no request holds count as free"
    # A new prompt needing three blocks takes the free blocks least recently used: "old"'s.
    scheduler.add_request(_prompt_request("other", list(range(500, 511))))
    _finish(scheduler, "other")
    scheduler.add_request(_prompt_request("recent again", recent))
    assert scheduler.schedule().sequences[0].start_position == 8, "recent's prefix survived"
    _finish(scheduler, "recent again")
    scheduler.add_request(_prompt_request("old again", old))
    assert scheduler.schedule().sequences[0].start_position == 0, "old's was evicted"


def test_an_aborted_or_preempted_request_releases_shared_blocks_correctly() -> None:
    blocks = BlockManager(8, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4), blocks, 1024)
    prompt = list(range(600, 609))
    scheduler.add_request(_prompt_request("a", prompt))
    _run(scheduler)
    scheduler.add_request(_prompt_request("b", prompt))
    _run(scheduler)
    shared = scheduler.requests["a"].block_ids[:2]
    assert scheduler.requests["b"].block_ids[:2] == shared
    assert [blocks.blocks[i].ref_count for i in shared] == [2, 2]
    scheduler.abort_requests(["a"])
    assert [blocks.blocks[i].ref_count for i in shared] == [1, 1]
    scheduler.abort_requests(["b"])
    assert [blocks.blocks[i].ref_count for i in shared] == [0, 0]
    assert len(blocks.free_blocks) == 8 and blocks.usage == 0.0
