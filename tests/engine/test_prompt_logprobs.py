"""Prompt logprobs through the engine (`SamplingParams.prompt_logprobs`): the scheduler names
what each step scores, concatenates the chunks, skips the prefix cache until the prompt is
scored and sends the scores once, with the first output; the offline `LLM` and the async client
give them as `RequestOutput.prompt_logprobs`, bitwise the same chunked or whole, alone or
batched, with a warm prefix cache or a cold one."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import msgspec
import pytest
import torch

from rankcast import LLM, SamplingParams
from rankcast.config import SchedulerConfig
from rankcast.engine_core.block_manager import BlockManager
from rankcast.engine_core.request import Request
from rankcast.engine_core.scheduler import Scheduler
from rankcast.outputs import Logprob, RequestOutput
from rankcast.protocol import (
    EngineCoreRequest,
    GetStats,
    ModelRunnerOutput,
    PromptLogprobs,
    SchedulerOutput,
    TokenLogprobs,
)

TOP = 2
PROMPT = [random.Random(4).randrange(1, 4000) for _ in range(45)]
OTHERS = [[random.Random(i).randrange(1, 4000) for _ in range(9 + 7 * i)] for i in range(3)]

# ---- the scheduler, without a model ----


def _request(rid: str, prompt_len: int, prompt_logprobs: int | None = TOP) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=50, prompt_logprobs=prompt_logprobs)
    return Request(rid, list(range(100, 100 + prompt_len)), params, 50, frozenset({-1}))


def _step(scheduler: Scheduler, mark: float = 0.0) -> tuple[SchedulerOutput, list]:
    """One step as the output rank would answer it: token 7 for each sampling sequence, and a
    score for each named prompt target whose logprob says its position (minus `mark`)."""
    batch = scheduler.schedule()
    sampled = [s.request_id for s in batch.sequences if s.sample]
    scored = [
        PromptLogprobs(
            s.request_id,
            s.start_position + 1,
            [
                TokenLogprobs(token, -(s.start_position + 1 + i) - mark, 1)
                for i, token in enumerate(s.prompt_logprob_targets)
            ],
        )
        for s in batch.sequences
        if s.prompt_logprob_targets
    ]
    result = ModelRunnerOutput(sampled, [[7]] * len(sampled), prompt_logprobs=scored or None)
    return batch, [output for _, output in scheduler.update_from_output(result)]


def test_each_chunk_names_the_prompt_tokens_it_scores_and_the_first_output_carries_them() -> None:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4)
    scheduler = Scheduler(config, BlockManager(64, 4), 1024)
    scheduler.add_request(_request("a", 10))
    targets = []
    for _ in range(3):
        batch, outputs = _step(scheduler)
        targets.append(batch.sequences[0].prompt_logprob_targets)
    # The row at position p scores the token at p + 1: a chunk's last row scores the next
    # chunk's first token, and the prompt's last row samples instead.
    assert targets == [[101, 102, 103, 104], [105, 106, 107, 108], [109]]
    (first,) = outputs
    assert first.new_token_ids == [7] and first.prompt_logprobs is not None
    assert [lp.token_id for lp in first.prompt_logprobs] == list(range(101, 110))
    assert [lp.logprob for lp in first.prompt_logprobs] == [-p for p in range(1, 10)]
    batch, (second,) = _step(scheduler)
    assert batch.sequences[0].prompt_logprob_targets is None, "decodes score nothing"
    assert second.prompt_logprobs is None, "sent once"


def test_a_request_without_prompt_logprobs_names_no_targets_and_gets_none() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4), BlockManager(64, 4), 1024)
    scheduler.add_request(_request("a", 10, prompt_logprobs=None))
    batch, (output,) = _step(scheduler)
    assert batch.sequences[0].prompt_logprob_targets is None and output.prompt_logprobs is None


def test_a_one_token_prompt_gets_an_empty_list() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4), BlockManager(64, 4), 1024)
    scheduler.add_request(_request("a", 1))
    batch, (output,) = _step(scheduler)
    assert batch.sequences[0].prompt_logprob_targets is None and output.prompt_logprobs == []


def test_the_prefix_cache_is_skipped_and_not_counted_until_the_prompt_is_scored() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4), BlockManager(64, 4), 1024)
    scheduler.add_request(_request("warm", 17, prompt_logprobs=None))
    _step(scheduler)
    scheduler.abort_requests(["warm"])
    queried, hits = scheduler.blocks.queried_tokens, scheduler.blocks.hit_tokens
    scheduler.add_request(_request("scored", 17))
    batch, _ = _step(scheduler)
    (seq,) = batch.sequences
    assert seq.start_position == 0 and len(seq.token_ids) == 17, "the whole prompt computed"
    assert (scheduler.blocks.queried_tokens, scheduler.blocks.hit_tokens) == (queried, hits)
    # Without prompt logprobs the same prompt takes the cached blocks (the control).
    scheduler.add_request(_request("cached", 17, prompt_logprobs=None))
    batch, _ = _step(scheduler)
    assert [s.start_position for s in batch.sequences if s.request_id == "cached"] == [16]


def test_a_prompt_preempted_while_scored_is_scored_again_and_sent_once() -> None:
    """Preempted mid-prefill, a request computes its prompt again from the start (no prefix
    hits while it is scored): the recomputed scores replace the first ones."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8)
    scheduler = Scheduler(config, BlockManager(6, 4, enable_prefix_caching=False), 1024)
    scheduler.add_request(_request("old", 8, prompt_logprobs=None))
    scheduler.add_request(_request("new", 14))
    _step(scheduler)  # old's prompt takes the whole budget
    batch, _ = _step(scheduler)  # old decodes, new's first chunk: positions 0-6
    assert [s.prompt_logprob_targets for s in batch.sequences if s.request_id == "new"] == [
        list(range(101, 108))
    ]
    _step(scheduler)  # new cannot get its blocks: preempted
    assert scheduler.num_preemptions == 1 and scheduler.waiting[0].request_id == "new"
    scheduler.abort_requests(["old"])
    sent = []
    while not sent:
        batch, outputs = _step(scheduler, mark=0.5)  # a recompute's scores differ here
        assert all(s.start_position > 0 or s.prompt_logprob_targets for s in batch.sequences)
        sent = [o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None]
    (scores,) = sent
    assert [lp.token_id for lp in scores] == list(range(101, 114))
    assert [lp.logprob for lp in scores] == [-p - 0.5 for p in range(1, 14)]


def test_a_recompute_after_the_scores_were_sent_scores_nothing() -> None:
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=8), BlockManager(5, 4, enable_prefix_caching=False), 1024
    )
    scheduler.add_request(_request("old", 8, prompt_logprobs=None))
    scheduler.add_request(_request("new", 8))
    _, outputs = _step(scheduler)
    assert [o.prompt_logprobs is not None for o in outputs] == [False, True]
    _step(scheduler)  # "new" is preempted after its scores were sent
    scheduler.abort_requests(["old"])
    batch, outputs = _step(scheduler)
    (recompute,) = batch.sequences
    assert recompute.start_position == 0 and recompute.prompt_logprob_targets is None
    assert outputs[0].prompt_logprobs is None


def test_out_of_range_values_are_refused_naming_the_field() -> None:
    for bad in (-1, 21):
        with pytest.raises(ValueError, match=r"prompt_logprobs must be in \[0, 20\]"):
            SamplingParams(prompt_logprobs=bad)
    # The same on the wire: an engine core never accepts such a request.
    raw = msgspec.msgpack.encode(["add", "r", [1, 2], {"prompt_logprobs": 99}])
    with pytest.raises(msgspec.ValidationError, match="prompt_logprobs"):
        msgspec.msgpack.decode(raw, type=EngineCoreRequest)
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0
    assert SamplingParams(prompt_logprobs=20).prompt_logprobs == 20


# ---- through the engine: the offline LLM and the async client ----

OPTIONS = dict(dtype="float32", kv_cache_space_gib=0.05, max_num_seqs=8)
SCORED = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=TOP)


def _scores(output: RequestOutput) -> list[dict[int, Logprob] | None]:
    assert output.prompt_logprobs is not None
    return output.prompt_logprobs


@pytest.fixture(scope="module")
def whole(tiny_llama_dir: Path) -> RequestOutput:
    """The prompt alone on an engine that takes prompts whole."""
    with LLM(str(tiny_llama_dir), enable_chunked_prefill=False, **OPTIONS) as llm:
        return llm.generate([PROMPT], SCORED)[0]


def test_llm_scores_each_prompt_token_as_transformers_does(
    tiny_llama_dir: Path, whole: RequestOutput
) -> None:
    import transformers

    from rankcast.tokenizer import load_tokenizer

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_llama_dir), dtype=torch.float32
    )
    with torch.no_grad():
        want = model(torch.tensor([PROMPT])).logits[0].float().log_softmax(dim=-1)
    tokenizer = load_tokenizer(tiny_llama_dir)
    scores = _scores(whole)
    assert len(scores) == len(PROMPT) and scores[0] is None
    for position, entry in enumerate(scores[1:], start=1):
        assert entry is not None
        row, token = want[position - 1], PROMPT[position]
        mine = entry[token]
        assert mine.logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert mine.rank == int((row > row[token]).sum()) + 1
        top = row.topk(TOP).indices.tolist()
        assert set(entry) == {token, *top}, f"the prompt token and the top {TOP}"
        for rank, tid in enumerate(top, start=1):
            if tid != token:
                assert entry[tid].rank == rank
        for tid, logprob in entry.items():
            assert logprob.decoded_token == tokenizer.decode([tid], skip_special_tokens=False)


def test_llm_scores_chunked_batched_and_prefix_cached_prompts_bitwise_alike(
    tiny_llama_dir: Path, whole: RequestOutput
) -> None:
    with LLM(str(tiny_llama_dir), max_num_batched_tokens=16, **OPTIONS) as llm:
        chunked = llm.generate([PROMPT], SCORED)[0]
        assert _scores(chunked) == _scores(whole), "chunks of 16 tokens"
        assert chunked.outputs[0].token_ids == whole.outputs[0].token_ids
        plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        batched = llm.generate([*OTHERS, PROMPT], [plain] * len(OTHERS) + [SCORED])
        assert _scores(batched[-1]) == _scores(whole), "beside other requests"
        assert all(o.prompt_logprobs is None for o in batched[:-1]), "only askers get them"
        # The prompt's blocks are cached now (a request without prompt logprobs finds them,
        # the control); a scored one computes and scores it all, counting no lookup.
        before = llm.engine.call(GetStats())
        llm.generate([PROMPT], plain)
        warm = llm.engine.call(GetStats())
        assert warm.prefix_cache_hits > before.prefix_cache_hits
        cached = llm.generate([PROMPT], SCORED)[0]
        after = llm.engine.call(GetStats())
        assert _scores(cached) == _scores(whole), "with the prompt's blocks cached"
        assert (after.prefix_cache_queries, after.prefix_cache_hits) == (
            warm.prefix_cache_queries,
            warm.prefix_cache_hits,
        )


def test_asking_for_prompt_logprobs_changes_no_generated_token(
    tiny_llama_dir: Path, whole: RequestOutput
) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=TOP)
    with LLM(str(tiny_llama_dir), enable_chunked_prefill=False, **OPTIONS) as llm:
        (alone,) = llm.generate([PROMPT], plain)
    assert alone.outputs[0].token_ids == whole.outputs[0].token_ids
    assert alone.prompt_logprobs is None


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_with_tp_or_pp_the_output_rank_scores_them_alike(
    tiny_llama_dir: Path, whole: RequestOutput, tp: int, pp: int
) -> None:
    with LLM(
        str(tiny_llama_dir),
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        max_num_batched_tokens=16,
        **OPTIONS,
    ) as llm:
        (out,) = llm.generate([PROMPT], SCORED)
    scores = _scores(out)
    assert scores[0] is None and len(scores) == len(PROMPT)
    if pp > 1:  # the stages pass hidden states on exactly: the same bits as one rank
        assert scores == _scores(whole)
        return
    for got, want in zip(scores[1:], _scores(whole)[1:], strict=True):  # TP sums in pieces
        assert got is not None and want is not None and set(got) == set(want)
        for tid in want:
            assert got[tid].logprob == pytest.approx(want[tid].logprob, abs=1e-4)


class _Observer:
    """The async client's metrics hook, unused here."""

    def record_scheduler_stats(self, *args: object) -> None: ...
    def record_engine_up(self, *args: object) -> None: ...
    def record_first_token(self, *args: object) -> None: ...
    def record_inter_token(self, *args: object) -> None: ...
    def record_step_end(self) -> None: ...
    def record_finished(self, *args: object) -> None: ...


def test_the_async_client_gives_them_from_the_first_output_on(
    tiny_llama_dir: Path, whole: RequestOutput
) -> None:
    from rankcast.engine_client.async_llm import AsyncLLM
    from rankcast.engine_client.mp_client import AsyncMPClient
    from rankcast.tokenizer import load_tokenizer
    from tests.engine.engine_process import engine_core_process

    async def stream(addresses) -> list[RequestOutput]:
        client = AsyncMPClient(addresses.clients[0], 0)
        llm = AsyncLLM([client], load_tokenizer(tiny_llama_dir), _Observer())
        await llm.start()
        try:
            return [out async for out in llm.generate("r", PROMPT, SCORED)]
        finally:
            llm.shutdown()

    with engine_core_process(
        tiny_llama_dir, clients=1, max_num_batched_tokens=16, max_num_seqs=8
    ) as (
        _,
        addresses,
    ):
        outputs = asyncio.run(stream(addresses))
    assert outputs and all(_scores(o) == _scores(whole) for o in outputs)
    assert outputs[-1].outputs[0].token_ids == whole.outputs[0].token_ids
