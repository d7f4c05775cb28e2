"""The KV cache's host memory: zeros, written by nobody at start-up (rankcast.worker.model_runner
`zeroed_tensor`), so a warm start does not pay to clear gigabytes it may never use."""

from __future__ import annotations

import os

import torch

from rankcast.worker.model_runner import zeroed_tensor

MIB = 1 << 20


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_the_cache_reads_as_zeros_and_costs_no_memory_until_written() -> None:
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
