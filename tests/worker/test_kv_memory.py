"""The KV cache's host memory (rankcast.worker.model_runner `zeroed_tensor`): zeros, taken at
start by default (issue 35: a rank's resident memory holds the whole cache before the first
request, so a machine that cannot hold it fails at start and memory stays flat as the prefix
cache cycles its blocks), or with RANKCAST_KV_CACHE_COMMIT=0 written by nobody at start-up (a
warm start that does not pay for gigabytes it may never use). The engine reports what its ranks
committed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from rankcast import LLM
from rankcast.worker.model_runner import commit_pages, zeroed_tensor

MIB = 1 << 20


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_lazy_cache_reads_as_zeros_and_costs_no_memory_until_written() -> None:
    before = _resident_bytes()
    cache = zeroed_tensor((2, 1024, 4, 16 * 512), torch.bfloat16, torch.device("cpu"))
    allocated = _resident_bytes() - before
    assert cache.shape == (2, 1024, 4, 8192) and cache.dtype == torch.bfloat16
    assert cache.numel() * 2 == 128 * MIB
    # torch.zeros would have written all 128 MiB here.
    assert allocated < 16 * MIB, allocated
    cache[1, 7, 3, :16] = 2.5
    assert cache[1, 7, 3, :16].eq(2.5).all()
    assert int(cache.count_nonzero()) == 16  # every other element reads as zero


def test_other_shapes_and_dtypes_and_an_empty_cache() -> None:
    cache = zeroed_tensor((3, 5, 7), torch.float32, torch.device("cpu"))
    assert cache.shape == (3, 5, 7) and not cache.any()
    cache += 1
    assert cache.sum() == 105
    assert zeroed_tensor((2, 0, 4), torch.float32, torch.device("cpu")).numel() == 0


@pytest.mark.parametrize("commit", [True, False])
def test_a_committed_cache_is_resident_at_once_and_a_lazy_one_is_not(commit: bool) -> None:
    before = _resident_bytes()
    cache = zeroed_tensor((2, 64, 2, MIB // 8), torch.float32, torch.device("cpu"))
    if commit:
        commit_pages(cache)
    grown = _resident_bytes() - before
    assert cache.shape == (2, 64, 2, MIB // 8)
    if commit:
        assert grown >= 0.95 * cache.numel() * 4, f"only {grown / MIB:.0f} MiB resident"
    else:
        assert grown < 16 * MIB, f"{grown / MIB:.0f} MiB resident before any write"
    assert float(cache[1, 63, 1, -1]) == 0.0 and float(cache[0, 0, 0, 0]) == 0.0


@pytest.mark.parametrize("commit", ["1", "0"])
def test_the_engine_commits_its_cache_before_the_first_step_and_reports_it(
    tiny_llama_dir: Path, commit: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANKCAST_KV_CACHE_COMMIT", commit)
    before = _resident_bytes()
    with LLM(str(tiny_llama_dir), dtype="float32", kv_cache_space_gib=0.25) as llm:
        core = llm.engine.client.core
        runner = core.executor.worker.runner
        cache_bytes = sum(c.numel() * c.element_size() for c in runner.kv_caches)
        llm.generate([[5, 6, 7]])  # the first step waits for the commit
        assert runner._commit is None
        grown = _resident_bytes() - before
        stats = core.stats()
    assert cache_bytes > 0.9 * 0.25 * 2**30
    if commit == "1":
        assert stats.kv_cache_committed_bytes == cache_bytes
        assert grown >= 0.95 * cache_bytes, f"{grown / MIB:.0f} MiB resident"
    else:
        assert stats.kv_cache_committed_bytes == 0
        assert grown < cache_bytes / 2, f"{grown / MIB:.0f} MiB resident after one request"
