"""The multiprocess executor: rank-ordered replies, named failures, no stale replies, TP."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from rankcast import LLM, SamplingParams, kernels, platform
from rankcast.executor.base import ExecutorError
from rankcast.protocol import ScheduledSequence, SchedulerOutput
from tests.executor.helpers import fail_on_rank, sleep_on_rank

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Water is"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def tp2(tiny_llama_dir: Path):
    llm = LLM(str(tiny_llama_dir), dtype="float32", tensor_parallel_size=2, kv_cache_space_gib=0.05)
    yield llm
    llm.shutdown()


def _executor(llm: LLM):
    return llm.engine.client.core.executor


def test_tp2_matches_tp1_on_a_tiny_model(tiny_llama_dir: Path, tp2: LLM) -> None:
    with LLM(str(tiny_llama_dir), dtype="float32", kv_cache_space_gib=0.05) as tp1:
        want = [o.outputs[0].token_ids for o in tp1.generate(PROMPTS, GREEDY)]
    assert [o.outputs[0].token_ids for o in tp2.generate(PROMPTS, GREEDY)] == want


def test_quantized_weights_shard_across_tensor_and_pipeline_ranks(tiny_llama_dir: Path) -> None:
    """int8 weights under TP and PP. A pipeline stage quantizes its own layers exactly as one
    rank does, so PP=2 generates what PP=1 does; a row-parallel shard takes its channel scales
    from its own slice of the inputs, so TP=2 is close to TP=1 but not bitwise (greedy text
    agrees where it is not a near tie)."""
    options = {"dtype": "float32", "kv_cache_space_gib": 0.05, "quantization": "int8"}
    with LLM(str(tiny_llama_dir), **options) as one:
        want = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY)]
    with LLM(str(tiny_llama_dir), pipeline_parallel_size=2, **options) as pp:
        assert [o.outputs[0].token_ids for o in pp.generate(PROMPTS, GREEDY)] == want
    with LLM(str(tiny_llama_dir), tensor_parallel_size=2, **options) as tp:
        got = [o.outputs[0].token_ids for o in tp.generate(PROMPTS, GREEDY)]
    agreeing = sum(g[:4] == w[:4] for g, w in zip(got, want, strict=True))
    assert agreeing >= len(PROMPTS) - 1, (got, want)


def test_replies_come_back_in_rank_order(tp2: LLM) -> None:
    assert _executor(tp2).collective_rpc("rank_info") == [(0, 0, 0), (1, 0, 1)]
    assert _executor(tp2).collective_rpc("rank_info", unique_reply_rank=1) == [(1, 0, 1)]


def test_a_raising_rank_is_named_with_its_traceback(tp2: LLM) -> None:
    with pytest.raises(ExecutorError, match=r"rank 1 failed") as info:
        _executor(tp2).collective_rpc(fail_on_rank, (1,))
    assert "injected failure on rank 1" in str(info.value)
    assert "Traceback" in str(info.value)


def test_no_stale_reply_after_a_failed_or_timed_out_call(tp2: LLM) -> None:
    executor = _executor(tp2)
    before = executor.stale_replies
    # Rank 1 fails at once; rank 0 answers later, after the call has already failed.
    with pytest.raises(ExecutorError):
        executor.collective_rpc(fail_on_rank, (1, 0.5))
    # Rank 1 answers after the deadline.
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\]"):
        executor.collective_rpc(sleep_on_rank, (1, 2.5), timeout=1.0)
    # The next call must see its own replies, not the late ones of the calls above.
    assert executor.collective_rpc("rank_info") == [(0, 0, 0), (1, 0, 1)]
    # Both late replies (rank 0's to the failed call, rank 1's to the timed-out one) reach the
    # executor before this call's own replies on the same ordered sockets, and were dropped.
    assert executor.stale_replies - before >= 2
    assert [o.finished for o in tp2.generate(["hi"], GREEDY)] == [True]


def test_tp3_matches_tp1_on_smollm2(smollm_fp32: LLM) -> None:
    want = [o.outputs[0].token_ids for o in smollm_fp32.generate(PROMPTS, GREEDY)]
    with LLM(dtype="float32", tensor_parallel_size=3, kv_cache_space_gib=0.1) as tp3:
        assert [o.outputs[0].token_ids for o in tp3.generate(PROMPTS, GREEDY)] == want


def test_a_dead_rank_fails_the_engine_promptly(tiny_llama_dir: Path) -> None:
    with LLM(
        str(tiny_llama_dir), dtype="float32", tensor_parallel_size=2, kv_cache_space_gib=0.05
    ) as llm:
        executor = _executor(llm)
        os.kill(executor.procs[1].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(ExecutorError, match=r"rank 1 \(pid \d+\) died"):
            llm.generate(["hello"], SamplingParams(max_tokens=50, ignore_eos=True))
        assert time.monotonic() - start < 5


@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2)])
def test_pipeline_layouts_match_a_single_rank(tiny_llama_dir: Path, tp: int, pp: int) -> None:
    with LLM(str(tiny_llama_dir), dtype="float32", kv_cache_space_gib=0.05) as single:
        want = [o.outputs[0].token_ids for o in single.generate(PROMPTS, GREEDY)]
    with LLM(
        str(tiny_llama_dir),
        dtype="float32",
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        kv_cache_space_gib=0.05,
    ) as split:
        executor = _executor(split)
        assert [o.outputs[0].token_ids for o in split.generate(PROMPTS, GREEDY)] == want
        # Every rank runs the step and answers; only the output rank (TP rank 0, last stage)
        # answers with tokens.
        batch = SchedulerOutput(
            [ScheduledSequence("probe", [5, 6, 7], 0, [0], SamplingParams(temperature=0))]
        )
        replies = executor.collective_rpc("execute_model", (batch,))
        output_rank = (pp - 1) * tp
        assert [r.output is not None for r in replies] == [
            rank == output_rank for rank in range(tp * pp)
        ]


def test_pp2_matches_pp1_on_smollm2(smollm_fp32: LLM) -> None:
    want = [o.outputs[0].token_ids for o in smollm_fp32.generate(PROMPTS, GREEDY)]
    with LLM(dtype="float32", pipeline_parallel_size=2, kv_cache_space_gib=0.1) as pp2:
        assert [o.outputs[0].token_ids for o in pp2.generate(PROMPTS, GREEDY)] == want


def _allowed_cpus(pid: int) -> list[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return platform.parse_cpu_list(line.split(":", 1)[1].strip())
    raise AssertionError(f"no Cpus_allowed_list for {pid}")


def test_each_rank_runs_its_threads_on_its_own_cores(tp2: LLM) -> None:
    """Automatic binding: rank i's threads on the i-th equal slice of the allowed cores."""
    if not kernels.load():
        pytest.skip("thread binding comes with the built kernels")
    cores = sorted(os.sched_getaffinity(0))
    per = platform.threads_per_rank(2, tp2.config.parallel.num_threads)
    for rank, proc in enumerate(_executor(tp2).procs):
        assert _allowed_cpus(proc.pid) == cores[rank * per : (rank + 1) * per]
    assert _allowed_cpus(os.getpid()) == cores, "the caller's own process is never bound"
