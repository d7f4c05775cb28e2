"""Speculative decoding (`--speculative-config`): the answer is the one without it, token for
token, greedy and seeded, in batches beside requests that do not draft, with stops inside an
accepted run; a rejected draft never reaches the prefix cache or its vLLM-format events; the
counters count what the verifications did. The embedded model copying a passage gives real
drafts, accepted and rejected; the model-level proof that a verification row is its decode's
logits bit for bit is tests/model/test_batch_invariance.py's."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rankcast import LLM, SamplingParams
from rankcast.channel.vllm_kv_events import KVEventPublisher
from rankcast.config import ConfigError, EngineConfig, KVEventsConfig, SpeculativeConfig
from rankcast.engine_core.speculation.cost_model import StepCostModel
from rankcast.engine_core.speculation.ngram import NgramIndex
from rankcast.engine_core.speculation.suffix import SuffixCache
from rankcast.model.linear_kernels import choose_linear_path
from rankcast.platform import resolve_dtype
from tests.entrypoints.server_process import free_port
from tests.routing.kv_stream import subscribed, wait_for
from tests.routing.test_vllm_kv_events import rebuild

PASSAGE = (
    "It was a bright cold day in April, and the clocks were striking thirteen. Winston Smith, "
    "his chin nuzzled into his breast in an effort to escape the vile wind, slipped quickly "
    "through the glass doors of Victory Mansions, though not quickly enough to prevent a "
    "swirl of gritty dust from entering along with him."
)
# Chats whose answers copy from their input (drafts accepted, and rejected where the model
# departs from the text) and one that does not (few drafts, or none): one batch holds both.
CHATS = [
    [{"role": "user", "content": f"Repeat this passage exactly:\n\n{PASSAGE}"}],
    [{"role": "user", "content": f"Quote the first sentence of this passage:\n\n{PASSAGE}"}],
    [{"role": "user", "content": "Name three colours."}],
    [{"role": "user", "content": f"Who is named in this passage?\n\n{PASSAGE}"}],
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2}


# ---- configuration ----


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ({"method": "eagle", "num_speculative_tokens": 3}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 3, "model": "x"}, "'model'"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0}, "min"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 3,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_max",
        ),
        ({"method": "ngram", "num_speculative_tokens": "3"}, "num_speculative_tokens"),
        ({"method": "suffix", "prompt_lookup_min": 2}, "prompt_lookup_min"),
        ({"method": "suffix", "suffix_decoding_min_token_prob": 2}, "min_token_prob"),
        ({"num_speculative_tokens": 3}, "method"),
    ],
)
def test_a_bad_speculative_config_is_refused_naming_the_key(raw: dict[str, Any], named: str):
    with pytest.raises(ConfigError, match=named):
        EngineConfig.from_kwargs(speculative_config=raw)


def test_vllms_defaults_apply() -> None:
    ngram = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (ngram.prompt_lookup_min, ngram.prompt_lookup_max) == (5, 5)
    suffix = SpeculativeConfig.from_dict({"method": "suffix"})
    assert suffix.num_speculative_tokens == suffix.suffix_decoding_max_tree_depth == 24
    assert EngineConfig().scheduler.speculative_config is None, "off by default"


def test_get_server_info_names_the_method(tmp_path: Path) -> None:
    from rankcast.api_server.discovery import server_info
    from rankcast.api_server.server_config import ApiServerConfig

    spec = SpeculativeConfig.from_dict(NGRAM)
    config = ApiServerConfig("127.0.0.1", 8000, "m", tmp_path, "test", speculative_config=spec)
    described = server_info(config, 128)["vllm_config"]["speculative_config"]
    assert described["method"] == "ngram" and described["num_speculative_tokens"] == 5
    off = ApiServerConfig("127.0.0.1", 8000, "m", tmp_path, "test")
    assert server_info(off, 128)["vllm_config"]["speculative_config"] is None


# ---- the proposers and the cost model, alone ----


def test_the_ngram_index_drafts_what_followed_the_longest_recent_match() -> None:
    index = NgramIndex(2, 4)
    index.extend([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3])
    # [1 2 3] matched at 0 (three tokens) beats [2 3] at 6 (two): 4 5 follow it.
    assert index.propose(3) == [4, 5, 9]
    index.extend([7])  # [2 3 7] occurred at 6..8: 8 1 follows
    assert index.propose(2) == [8, 1]
    index.extend([6])  # [7 6] never occurred
    assert index.propose(4) == []
    short = NgramIndex(3, 3)
    short.extend([5, 5])
    assert short.propose(2) == []


def test_the_suffix_cache_drafts_a_repeated_answer_and_stops_where_answers_differ() -> None:
    config = SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 8})
    cache = SuffixCache(max_requests=4)
    cache.add([10, 11, 12, 13, 14, 15, 16])
    cache.add([10, 11, 12, 13, 20, 21, 22])
    own = NgramIndex(3, config.suffix_decoding_max_tree_depth)
    own.extend([1, 10, 11, 12])
    # Both earlier answers continue with 13, then disagree evenly (50 % >= 10 %): the most
    # frequent (the first seen) is followed, and the draft ends where matches run out.
    assert cache.propose(own, 8, config)[:1] == [13]
    strict = SpeculativeConfig.from_dict(
        {"method": "suffix", "suffix_decoding_min_token_prob": 0.9}
    )
    assert cache.propose(own, 8, strict) == [13], "a disputed continuation is not drafted"
    for _ in range(5):  # the oldest answers leave the cache
        cache.add([30, 31, 32, 33, 34])
    assert cache.propose(own, 8, config) == []


def test_the_cost_model_reads_between_and_beyond_what_it_measured() -> None:
    cost = StepCostModel()
    assert cost.seconds(4) is None
    cost.record(1, 3.0)  # an engine's first step: warming up, many times the others
    for _ in range(20):
        cost.record(1, 0.010)
        cost.record(16, 0.012)
        cost.record(256, 0.100)
    one, sixteen = cost.seconds(1), cost.seconds(16)
    assert one is not None and sixteen is not None
    assert one == pytest.approx(0.010) and sixteen == pytest.approx(0.012)
    between = cost.seconds(136)
    assert between is not None and 0.012 < between < 0.100
    beyond = cost.seconds(512)
    assert beyond is not None and beyond > 0.100


# ---- through the engine ----


def _texts(llm: LLM, params: SamplingParams | list[SamplingParams]) -> list[tuple[str, Any]]:
    return [(out.outputs[0].text, out.outputs[0].finish_reason) for out in llm.chat(CHATS, params)]


@pytest.fixture(scope="module", params=["float32", "auto"])
def dtype(request: pytest.FixtureRequest) -> str:
    """Both kernel paths the CPU runs by default (float32, and bfloat16 where it has it)."""
    import torch

    dtype = str(request.param)
    resolved = resolve_dtype(dtype, torch.device("cpu"))
    if not choose_linear_path(resolved, torch.device("cpu")).batch_invariant:
        pytest.skip(f"{resolved} linears are not batch-invariant here")
    return dtype


@pytest.fixture(scope="module")
def without(dtype: str) -> Iterator[LLM]:
    with LLM(dtype=dtype, kv_cache_space_gib=0.25, max_num_seqs=8) as llm:
        yield llm


@pytest.fixture(scope="module")
def speculating(dtype: str) -> Iterator[LLM]:
    """Drafts made to look free (`_FlatCost`): these tests check what a verification gives, and
    the measured cost model's choice of whether to widen a step moves with the machine's load
    (in a full suite beside idle-priority kernel builds one run drafted only tokens that were
    then accepted, and the check that some are rejected failed)."""
    with LLM(dtype=dtype, kv_cache_space_gib=0.25, max_num_seqs=8, speculative_config=NGRAM) as llm:
        drafter = llm.engine.client.core.scheduler.drafter
        assert drafter is not None
        drafter.cost = _FlatCost()
        yield llm


def _default_path_only(dtype: str) -> None:
    """Exactness is checked on both paths (greedy and seeded answers here, logits bit for bit
    in tests/model/test_batch_invariance.py); the rest of what must hold, on the path users
    run by default, to keep the suite's time."""
    if dtype != "auto":
        pytest.skip("checked on the default path")


class _FlatCost(StepCostModel):
    """Every step takes the same time, however many tokens: a wider step is then worth any
    draft expected to be accepted at all (the measured model's decision taken out of a test
    that checks exactness, not the decision)."""

    def seconds(self, tokens: int) -> float | None:
        return 0.01


def _counters(llm: LLM) -> tuple[int, int, int, list[int]]:
    stats = llm.engine.client.core.scheduler.stats()
    return (
        stats.spec_decode_num_drafts,
        stats.spec_decode_num_draft_tokens,
        stats.spec_decode_num_accepted_tokens,
        stats.spec_decode_num_accepted_tokens_per_pos,
    )


def test_greedy_answers_are_the_same_token_for_token(without: LLM, speculating: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=64)
    want = _texts(without, greedy)
    before = _counters(speculating)
    got = _texts(speculating, greedy)
    drafts, drafted, accepted, per_position = _counters(speculating)
    assert got == want
    assert drafts > before[0] and accepted > before[2], "the copies were drafted and accepted"
    assert drafted - before[1] > accepted - before[2], "and some drafts were rejected"
    assert len(per_position) == NGRAM["num_speculative_tokens"]
    assert sum(per_position) == accepted
    assert per_position == sorted(per_position, reverse=True), "a later draft needs the earlier"
    # Each request alone gives its answer in the batch, too.
    alone = [
        (out.outputs[0].text, out.outputs[0].finish_reason)
        for out in speculating.chat([CHATS[0]], greedy)
    ]
    assert alone == want[:1]


def test_stops_and_lengths_inside_an_accepted_run_end_where_they_would(
    dtype: str, without: LLM, speculating: LLM
) -> None:
    _default_path_only(dtype)
    reference = without.chat([CHATS[0]], SamplingParams(temperature=0.0, max_tokens=48))[0]
    tokens = reference.outputs[0].token_ids
    stop_token = tokens[20]  # somewhere inside a copied run
    cases = [
        SamplingParams(temperature=0.0, max_tokens=23),
        SamplingParams(temperature=0.0, max_tokens=48, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0.0, max_tokens=48, stop=["clocks"]),
        SamplingParams(temperature=0.0, max_tokens=48, logprobs=2),
    ]
    for params in cases:
        want = without.chat([CHATS[0]], params)[0].outputs[0]
        got = speculating.chat([CHATS[0]], params)[0].outputs[0]
        assert (got.text, got.token_ids, got.finish_reason) == (
            want.text,
            want.token_ids,
            want.finish_reason,
        ), params
        if params.logprobs:
            assert got.logprobs is not None and want.logprobs is not None
            assert len(got.logprobs) == len(want.logprobs) == len(want.token_ids)
            for mine, theirs in zip(got.logprobs, want.logprobs, strict=True):
                assert mine == theirs


def test_seeded_sampling_draws_the_same_tokens(without: LLM, speculating: LLM) -> None:
    """A seeded request's noise comes from its own generator position by position, rewound
    past rejected rows, so it samples what it samples without drafts."""
    params = [
        SamplingParams(temperature=0.3, top_k=20, seed=seed, max_tokens=48) for seed in range(4)
    ]
    before = _counters(speculating)[2]
    assert _texts(speculating, params) == _texts(without, params)
    assert _counters(speculating)[2] > before, "drafts were accepted while sampling"


def test_unseeded_sampling_keeps_the_models_distribution(
    dtype: str, without: LLM, speculating: LLM
) -> None:
    """Without a seed, the tokens after a copied run are sampled from the model either way: the
    frequencies of the first sampled tokens agree (a chi-square test at p = 0.001)."""
    _default_path_only(dtype)
    chat = [{"role": "user", "content": f"Continue this passage:\n\n{PASSAGE}"}]
    params = SamplingParams(temperature=1.0, max_tokens=3)
    runs = 150

    def first_tokens(llm: LLM) -> collections.Counter[tuple[int, ...]]:
        outs = llm.chat([chat] * runs, params)
        return collections.Counter(tuple(out.outputs[0].token_ids[:2]) for out in outs)

    a, b = first_tokens(without), first_tokens(speculating)
    # Pool the rare outcomes so every cell expects enough counts for the test.
    common = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]
    rows = [[a[k], b[k]] for k in common]
    rows.append([runs - sum(a[k] for k in common), runs - sum(b[k] for k in common)])
    rows = [row for row in rows if sum(row) > 0]
    statistic = 0.0
    for row in rows:
        expected = sum(row) / 2
        statistic += sum((count - expected) ** 2 / expected for count in row)
    import torch

    # The chi-square survival function: the regularized upper incomplete gamma function.
    freedom = torch.tensor((len(rows) - 1) / 2, dtype=torch.float64)
    p_value = float(torch.special.gammaincc(freedom, torch.tensor(statistic / 2).double()))
    assert len(rows) >= 2, "the first tokens vary"
    assert p_value > 0.001, (p_value, a.most_common(5), b.most_common(5))


def test_a_rejected_token_is_never_announced(dtype: str) -> None:
    """Through verifications that reject, the vLLM-format stream stores exactly the blocks full
    of the requests' own tokens: none holds a draft the model turned down."""
    _default_path_only(dtype)
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    events = KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint, topic="spec")
    # The offline engine runs its core in this process: the publisher `rankcast serve`'s
    # engine-core process attaches (core_proc.py) is attached here the same way.
    publisher = KVEventPublisher.create(events, 0)
    assert publisher is not None
    with (
        contextlib.closing(publisher),
        subscribed([endpoint], b"spec") as (stream,),
        LLM(
            kv_cache_space_gib=0.25,
            speculative_config=NGRAM,
            kv_events_config=events,
        ) as llm,
    ):
        llm.engine.client.core.kv_event_sinks.append(publisher.publish_events)
        publisher.start()
        outs = llm.chat(CHATS, SamplingParams(temperature=0.0, max_tokens=64))
        _, drafted, accepted, _ = _counters(llm)
        assert drafted > accepted > 0, "drafts were accepted and rejected"
        block = 16
        expected: set[tuple[int, ...]] = set()
        for out in outs:
            tokens = out.prompt_token_ids + out.outputs[0].token_ids
            computed = len(tokens) - 1  # the last token's K/V is computed by a next step only
            expected |= {
                tuple(tokens[i * block : (i + 1) * block]) for i in range(computed // block)
            }
        wait_for(
            lambda: {t for _, t in rebuild(stream.snapshot()).values()} >= expected,
            "the stream's stored blocks",
        )
        stored = {tokens for _, tokens in rebuild(stream.snapshot()).values()}
    assert stored == expected


def test_structured_answers_check_their_drafts_against_the_grammar(
    dtype: str, without: LLM, speculating: LLM
) -> None:
    """JSON pulled out of a document, under a schema: the drafts (the document's own words)
    are masked by the grammar row by row, and the answer is the one without drafts."""
    from rankcast.structured_outputs import StructuredOutputs

    _default_path_only(dtype)
    document = (
        "Invoice 4471 from Harbour Supplies Ltd, dated 3 March 2026, for 12 coils of rope at "
        "14.50 each, total 174.00, payable to Harbour Supplies Ltd within 30 days."
    )
    chat = [
        {
            "role": "user",
            "content": f"Extract the supplier, the invoice number and the total as JSON from:"
            f"\n\n{document}\n\nThen repeat the document.",
        }
    ]
    schema = {
        "type": "object",
        "properties": {
            "supplier": {"type": "string"},
            "invoice": {"type": "string"},
            "total": {"type": "string"},
            "document": {"type": "string"},
        },
        "required": ["supplier", "invoice", "total", "document"],
    }
    params = SamplingParams(
        temperature=0.0, max_tokens=96, structured=StructuredOutputs(json=schema)
    )
    before = _counters(speculating)
    want = without.chat([chat, CHATS[0]], params)
    got = speculating.chat([chat, CHATS[0]], params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert _counters(speculating)[2] > before[2], "drafts were accepted under the grammar"


def test_ranks_adapters_and_chunks_keep_the_answer(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Speculation over TP=2 x PP=2 ranks, a LoRA adapter and prompts chunked over steps: the
    same tokens as the same engine without it. The tiny model copies nothing from its prompt,
    so suffix decoding drafts each answer from the one before (each prompt is sent twice)."""
    import random

    from rankcast import LoRARequest
    from tests.lora.conftest import make_adapter

    adapter = tmp_path / "adapter"
    make_adapter(tiny_llama_dir, adapter)
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 250) for _ in range(rng.randrange(20, 40))] for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    lora = LoRARequest("a", str(adapter))
    engine = {
        "dtype": "float32",
        "kv_cache_space_gib": 0.05,
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 2,
        "max_num_batched_tokens": 16,  # the prompts come in chunks
        "max_num_seqs": 4,
        "enable_lora": True,
        "max_lora_rank": 8,
    }

    def answers(llm: LLM) -> list[list[int]]:
        got = []
        for _ in range(2):
            for lora_request in (None, lora):
                outs = llm.generate(prompts, params, lora_request=lora_request)
                got += [out.outputs[0].token_ids for out in outs]
        return got

    with LLM(str(tiny_llama_dir), **engine) as llm:
        want = answers(llm)
    with LLM(str(tiny_llama_dir), speculative_config={"method": "suffix"}, **engine) as llm:
        # Four ranks on this machine's cores time their steps too unevenly for the measured
        # cost model to be sure to widen any: drafts are made to look free, so they are weighed.
        drafter = llm.engine.client.core.scheduler.drafter
        assert drafter is not None
        drafter.cost = _FlatCost()
        got = answers(llm)
        accepted = _counters(llm)[2]
    assert got == want
    assert accepted > 0, "the repeated answers were drafted and accepted"
