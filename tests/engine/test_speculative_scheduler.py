"""Speculative decoding in the scheduler, without a model: what a verification's result does
to a request's tokens, its computed count, its blocks and the KV-cache events, when drafts are
accepted, rejected, cut by a stop, or the request is aborted while the step runs."""

from __future__ import annotations

from rankcast.channel.events import KVBlocksStored
from rankcast.config import SchedulerConfig, SpeculativeConfig
from rankcast.engine_core.block_manager import BlockManager
from rankcast.engine_core.request import Request
from rankcast.engine_core.scheduler import Scheduler
from rankcast.protocol import ModelRunnerOutput, SchedulerOutput
from rankcast.sampling_params import SamplingParams

BLOCK = 4
# The prompt repeats [1 2 3]: once the output reaches [3 4], prompt lookup drafts [5 6 1 2].
PROMPT = [1, 2, 3, 4, 5, 6, 1, 2, 3]
SPEC = SpeculativeConfig.from_dict(
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}
)


def _scheduler(params: SamplingParams | None = None) -> tuple[Scheduler, Request]:
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=4, speculative_config=SPEC),
        BlockManager(32, BLOCK, kv_events=True),
        1024,
    )
    assert scheduler.drafter is not None
    # What the engine core measures of its decode steps: a wider step costs a little more.
    for tokens in (1, 5):
        scheduler.drafter.record_step(tokens, 0.010 + 0.00001 * tokens)
    params = params or SamplingParams(temperature=0.0, max_tokens=50)
    request = Request("r", list(PROMPT), params, params.max_tokens or 50, frozenset({99}))
    scheduler.add_request(request)
    return scheduler, request


def _step(scheduler: Scheduler, tokens: list[int]) -> SchedulerOutput:
    batch = scheduler.schedule()
    scheduler.update_from_output(ModelRunnerOutput(["r"], [tokens]))
    return batch


def _stored_tokens(scheduler: Scheduler) -> list[list[int]]:
    events = scheduler.blocks.take_kv_events()
    return [
        e.token_ids[i * BLOCK : (i + 1) * BLOCK]
        for e in events
        if isinstance(e, KVBlocksStored)
        for i in range(len(e.block_hashes))
    ]


def _drafted(scheduler: Scheduler) -> SchedulerOutput:
    """The prompt, then the decode of 4 (after which the suffix [3 4] matches): the step that
    follows carries the drafts [5 6 1 2]."""
    _step(scheduler, [3])  # the prompt's step samples 3
    _step(scheduler, [4])
    batch = scheduler.schedule()
    (seq,) = batch.sequences
    assert seq.token_ids == [4, 5, 6, 1, 2] and seq.num_draft_tokens == 4
    assert seq.start_position == len(PROMPT) + 1
    return batch


def test_accepted_drafts_count_and_rejected_ones_never_reach_the_cache() -> None:
    scheduler, request = _scheduler()
    _drafted(scheduler)
    _stored_tokens(scheduler)  # the prompt's blocks
    # The model agrees with 5 and 6, then says 9 where 1 was drafted.
    scheduler.update_from_output(ModelRunnerOutput(["r"], [[5, 6, 9]]))
    assert request.output_token_ids == [3, 4, 5, 6, 9]
    # Computed: the prompt, 3, 4 (the step's newest), 5 and 6 (accepted); 9 is next step's.
    assert request.num_computed_tokens == len(PROMPT) + 4
    assert request.num_tokens - request.num_computed_tokens == 1
    all_tokens = request.all_token_ids
    stored = _stored_tokens(scheduler)
    assert stored == [all_tokens[8:12]], "the block full of own tokens only"
    assert all_tokens[13:15] != [1, 2], "the rejected drafts were not the request's tokens"
    counters = scheduler.drafter.counters  # type: ignore[union-attr]
    assert (counters.drafts, counters.draft_tokens, counters.accepted_tokens) == (1, 4, 2)
    assert counters.accepted_per_position == [1, 1, 0, 0]
    # The next step decodes from 9: the rejected drafts' slots are simply written over.
    (seq,) = scheduler.schedule().sequences
    assert seq.token_ids[0] == 9 and seq.start_position == len(PROMPT) + 4


def test_a_stop_inside_an_accepted_run_ends_the_request_there() -> None:
    scheduler, request = _scheduler(
        SamplingParams(temperature=0.0, max_tokens=50, stop_token_ids=[6])
    )
    _drafted(scheduler)
    _stored_tokens(scheduler)
    outputs = scheduler.update_from_output(ModelRunnerOutput(["r"], [[5, 6, 1, 2, 7]]))
    ((_, output),) = outputs
    assert output.new_token_ids == [5, 6] and output.finish_reason == "stop"
    assert output.stop_reason == 6
    assert request.output_token_ids == [3, 4, 5, 6]
    assert "r" not in scheduler.requests and len(scheduler.blocks.free_blocks) == 32
    assert _stored_tokens(scheduler) == [request.all_token_ids[8:12]], "own tokens only"


def test_no_draft_reaches_past_max_tokens_and_the_last_token_ends_the_request() -> None:
    scheduler, request = _scheduler(SamplingParams(temperature=0.0, max_tokens=5))
    _step(scheduler, [3])
    _step(scheduler, [4])
    (seq,) = scheduler.schedule().sequences
    assert seq.token_ids == [4, 5, 6], "three tokens are left: two drafted, one sampled after"
    ((_, output),) = scheduler.update_from_output(ModelRunnerOutput(["r"], [[5, 6, 1]]))
    assert request.output_token_ids == [3, 4, 5, 6, 1] and output.finish_reason == "length"


def test_an_abort_during_the_verification_loses_nothing() -> None:
    scheduler, request = _scheduler()
    _drafted(scheduler)
    _stored_tokens(scheduler)
    scheduler.abort_requests(["r"])
    assert scheduler.update_from_output(ModelRunnerOutput(["r"], [[5, 6, 1]])) == []
    assert request.output_token_ids == [3, 4] and request.finish_reason == "abort"
    assert len(scheduler.blocks.free_blocks) == 32
    assert _stored_tokens(scheduler) == [], "nothing of the aborted verification is announced"


def test_drafts_wait_for_the_first_measured_step() -> None:
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=4, speculative_config=SPEC), BlockManager(32, BLOCK), 1024
    )
    request = Request("r", list(PROMPT), SamplingParams(temperature=0.0), 50, frozenset())
    scheduler.add_request(request)
    _step(scheduler, [3])
    _step(scheduler, [4])
    (seq,) = scheduler.schedule().sequences
    assert seq.num_draft_tokens == 0, "no step measured yet: nothing to weigh a draft against"


def test_a_step_that_would_be_slower_drafts_nothing() -> None:
    scheduler, _ = _scheduler()
    assert scheduler.drafter is not None
    for _ in range(20):  # this machine: every extra token in a step costs a whole step
        scheduler.drafter.record_step(1, 0.010)
        scheduler.drafter.record_step(2, 0.020)
        scheduler.drafter.record_step(5, 0.050)
    _step(scheduler, [3])
    _step(scheduler, [4])
    (seq,) = scheduler.schedule().sequences
    assert seq.num_draft_tokens == 0
