"""Continuous batching, admission control and preemption, without a model."""

from __future__ import annotations

from rankcast.config import SchedulerConfig
from rankcast.engine.block_manager import BlockManager
from rankcast.engine.request import Request, RequestStatus
from rankcast.engine.scheduler import Scheduler
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


def _run(scheduler: Scheduler) -> tuple[bool, list[str]]:
    batch = scheduler.schedule()
    ids = [s.request_id for s in batch.sequences]
    scheduler.update_from_output(ModelRunnerOutput(ids, [7] * len(ids)))
    return batch.is_prefill, ids


def test_requests_join_and_leave_a_running_batch() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8), BlockManager(64, 4), 1024)
    scheduler.add_request(_request("a", 5, max_tokens=3))
    scheduler.add_request(_request("b", 6, max_tokens=10))
    assert _run(scheduler) == (True, ["a", "b"])
    assert _run(scheduler) == (False, ["a", "b"])
    scheduler.add_request(_request("c", 3, max_tokens=10))
    assert _run(scheduler) == (True, ["c"]), "a new request joins between steps"
    # "a" hit max_tokens=3 at its third token (the step that prefilled c did not run a or b).
    assert _run(scheduler) == (False, ["a", "b", "c"])
    assert "a" not in scheduler.requests, "a finished request leaves the batch"
    assert _run(scheduler) == (False, ["b", "c"])


def test_admission_waits_for_free_blocks_and_max_num_seqs() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2), BlockManager(6, 4), 1024)
    for rid in "abc":
        scheduler.add_request(_request(rid, 8))
    prefill, ids = _run(scheduler)
    assert prefill and ids == ["a", "b"], "max_num_seqs caps the batch"
    assert scheduler.waiting[0].request_id == "c"
    assert scheduler.stats().num_waiting_reqs == 1 and scheduler.stats().num_running_reqs == 2


def test_full_cache_preempts_the_newest_and_recomputes_it_later() -> None:
    blocks = BlockManager(5, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8), blocks, 1024)
    scheduler.add_request(_request("old", 8))
    scheduler.add_request(_request("new", 8))
    _run(scheduler)  # both prefilled: 2 + 2 blocks, 1 free
    _run(scheduler)  # 9 tokens each: "old" takes the last free block, "new" must yield
    assert scheduler.num_preemptions == 1
    preempted = scheduler.waiting[0]
    assert preempted.request_id == "new" and preempted.status == RequestStatus.WAITING
    assert preempted.block_ids == [] and len(preempted.output_token_ids) == 1
    # When "old" finishes, "new" is prefilled again with its prompt and generated tokens.
    scheduler.abort_requests(["old"])
    batch = scheduler.schedule()
    assert batch.is_prefill and batch.sequences[0].token_ids == preempted.all_token_ids
    assert "old" in batch.finished_request_ids


def test_usage_is_a_fraction() -> None:
    blocks = BlockManager(10, 4)
    scheduler = Scheduler(SchedulerConfig(), blocks, 1024)
    scheduler.add_request(_request("a", 10))
    _run(scheduler)
    assert scheduler.stats().kv_cache_usage == 0.3
