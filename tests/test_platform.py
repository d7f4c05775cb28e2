"""What the machine gives each rank: CPU lists, thread binding choices, dtypes."""

from __future__ import annotations

import pytest
import torch

from rankcast import platform


def test_cpu_lists_parse_ranges_and_singles() -> None:
    assert platform.parse_cpu_list("0-3,6") == [0, 1, 2, 3, 6]
    assert platform.parse_cpu_list("5") == [5]
    with pytest.raises(ValueError, match="RANKCAST_CPU_BIND"):
        platform.parse_cpu_list("0-x")


def test_automatic_binding_only_in_rankcasts_own_processes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(platform.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert platform.cpus_for_rank(0, 1, own_process=False) is None
    assert platform.cpus_for_rank(0, 2, own_process=True) == [0, 1]
    assert platform.cpus_for_rank(1, 2, own_process=True) == [2, 3]
    # More ranks than cores: the ones that get no core of their own are left unbound.
    assert platform.cpus_for_rank(4, 5, own_process=True) is None
    # A thread count the engine was given sets each rank's slice.
    assert platform.cpus_for_rank(1, 2, own_process=True, num_threads=1) == [1]


def test_explicit_lists_apply_everywhere_and_off_binds_nothing() -> None:
    lists = "2-3|0,1"
    assert platform.cpus_for_rank(0, 2, own_process=False, setting=lists) == [2, 3]
    assert platform.cpus_for_rank(1, 2, own_process=True, setting=lists) == [0, 1]
    with pytest.raises(ValueError, match="2 CPU list"):
        platform.cpus_for_rank(0, 3, own_process=True, setting=lists)
    assert platform.cpus_for_rank(0, 1, own_process=True, setting="off") is None


def test_a_rank_applies_its_engines_settings_not_its_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rank reads nothing from its environment: what the engine settled is what counts."""
    monkeypatch.setenv("RANKCAST_CPU_BIND", "garbage")
    monkeypatch.setenv("RANKCAST_NUM_THREADS", "garbage")
    monkeypatch.setattr(platform.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert platform.cpus_for_rank(0, 2, own_process=True) == [0, 1]
    assert platform.threads_per_rank(2) == 2
    assert platform.threads_per_rank(2, 3) == 3


def test_auto_dtype_is_float32_without_native_bf16_or_the_bf16_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(platform, "cpu_has_fast_bf16", lambda: False)
    monkeypatch.setattr(platform, "packed_bf16_kernel", lambda: False)
    assert platform.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    monkeypatch.setattr(platform, "packed_bf16_kernel", lambda: True)
    assert platform.resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    monkeypatch.setattr(platform, "packed_bf16_kernel", lambda: False)
    monkeypatch.setattr(platform, "cpu_has_fast_bf16", lambda: True)
    assert platform.resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    assert platform.resolve_dtype("float32", torch.device("cpu")) == torch.float32


def test_the_bf16_kernel_is_there_on_avx2_and_avx512_bf16_cpus() -> None:
    """What `auto` relies on, for the CPUs this build knows: rankcast's bfloat16 matmul exists
    with AVX512-BF16 or with AVX2 (and no AVX-512), not on AVX-512 without BF16."""
    avx512 = bool(torch.cpu._is_avx512_supported())
    avx512_bf16 = bool(torch.cpu._is_avx512_bf16_supported())
    avx2 = bool(torch.cpu._is_avx2_supported())
    expected = avx512_bf16 or (avx2 and not avx512)
    assert platform.packed_bf16_kernel() == expected


def test_adapters_compute_in_float32_where_half_precision_matmuls_are_emulated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setattr(platform, "cpu_has_fast_bf16", lambda: False)
    assert platform.lora_compute_dtype(torch.bfloat16, cpu) == torch.float32
    assert platform.lora_compute_dtype(torch.float16, cpu) == torch.float32
    assert platform.lora_compute_dtype(torch.float32, cpu) == torch.float32
    assert platform.lora_compute_dtype(torch.bfloat16, cuda) == torch.bfloat16
    monkeypatch.setattr(platform, "cpu_has_fast_bf16", lambda: True)
    assert platform.lora_compute_dtype(torch.bfloat16, cpu) == torch.bfloat16
    assert platform.lora_compute_dtype(torch.float16, cpu) == torch.float32


def test_ranks_of_one_engine_get_a_gpu_each_and_engines_may_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The device choice on a GPU machine (the count patched: these machines have none; the
    real run is tests/test_cuda.py). Data-parallel engines wrap around the GPUs; one engine
    asking for more ranks than GPUs is refused with the flags and the way out named."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert platform.device_for_rank(0, 2) == torch.device("cuda", 0)
    assert platform.device_for_rank(1, 2) == torch.device("cuda", 1)
    assert platform.device_for_rank(3, 1) == torch.device("cuda", 1)  # engine 3 of DP 4
    with pytest.raises(RuntimeError, match=r"3 ranks per engine .* this machine has 2") as refused:
        platform.device_for_rank(0, 3)
    assert "--tensor-parallel-size" in str(refused.value)
    assert "CUDA_VISIBLE_DEVICES" in str(refused.value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert platform.device_for_rank(5, 8) == torch.device("cpu")


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_a_rank_counts_its_engines_ranks_on_its_machine_except_under_ray(
    monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """Two ranks of one engine and one GPU: refused with the multiprocess executor (both would
    be on this machine), left to Ray (which may place them on two machines, a GPU each)."""
    from pathlib import Path

    from rankcast.config import EngineConfig
    from rankcast.model_files.source import ModelSource
    from rankcast.worker.worker import Worker

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    config = EngineConfig.from_kwargs(tensor_parallel_size=2, distributed_executor_backend=backend)
    worker = Worker(config, ModelSource(Path("unused"), Path("unused"), "unused"), rank=1)
    threads = torch.get_num_threads()
    # init_device seeds torch and sets its thread count: neither may leak into other tests.
    with torch.random.fork_rng(devices=[]):
        try:
            if backend == "mp":
                with pytest.raises(RuntimeError, match="2 ranks per engine"):
                    worker.init_device()
            else:
                worker.init_device()
                assert worker.device == torch.device("cuda", 0)
        finally:
            torch.set_num_threads(threads)
