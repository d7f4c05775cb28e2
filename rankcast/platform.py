"""What this machine offers: device, default precision and thread count per rank."""

from __future__ import annotations

import os

import torch

from rankcast import kernels

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_for_rank(local_rank: int, ranks_per_engine: int = 1) -> torch.device:
    """One CUDA device per local rank when torch sees CUDA, the CPU otherwise.

    Data-parallel engines may share a GPU (each is a world of its own), but the ranks of one
    engine may not: NCCL refuses two ranks of a group on one device, with an error about
    duplicate GPUs that names neither the flag nor the fix, so this says both first."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if ranks_per_engine > count:
        raise RuntimeError(
            f"{ranks_per_engine} ranks per engine (--tensor-parallel-size x "
            f"--pipeline-parallel-size) need as many CUDA devices, and this machine has {count}: "
            "lower the parallel sizes, or hide the GPUs (CUDA_VISIBLE_DEVICES=) to run on the CPU"
        )
    return torch.device("cuda", local_rank % count)


def cpu_has_fast_bf16() -> bool:
    """True where oneDNN runs bfloat16 matmuls natively (AMX or AVX512-BF16)."""
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


def packed_bf16_kernel() -> bool:
    """True where this process runs rankcast's own bfloat16 matmul (its kernels are loaded and
    built with one: AVX512-BF16, or AVX2 with FMA, which widens bfloat16 weights in registers)."""
    return kernels.load() and bool(torch.ops.rankcast.packed_linear_supported(torch.bfloat16))


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` means bfloat16 where it is the faster path, float32 elsewhere (docs/speed.md's table).

    With AMX or AVX512-BF16 the hardware multiplies bfloat16 itself. On AVX2-only CPUs
    rankcast's kernel reads bfloat16 weights (half float32's bytes) and computes in float32:
    measured on a 2-core Zen 3, 1.45-1.75x float32's single-stream speed and 1.02-1.08x its
    batch-32 (two runs).
    Without the kernels, bfloat16 there is emulated and far slower, so float32 it is.
    """
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_fast_bf16() or packed_bf16_kernel() else torch.float32


def lora_compute_dtype(model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """What LoRA adapters' small matmuls run in: the model's dtype, except half precision on
    CPUs that do not multiply bfloat16 natively (AVX2 only). There rankcast's own kernel runs
    the base linears in bfloat16, but the adapters go through torch, whose half-precision
    matmuls are emulated: for a rank-8 shrink/expand pair on 32 rows, 437 us in bfloat16 against
    51 us in float32 (2-core Zen 3), 210 such pairs per step on SmolLM2. Float32 slots cost
    twice the memory and change nothing in the result but rounding.
    """
    if device.type != "cpu" or model_dtype == torch.float32:
        return model_dtype
    if model_dtype == torch.bfloat16 and cpu_has_fast_bf16():
        return model_dtype
    return torch.float32


def parse_cpu_list(text: str) -> list[int]:
    """`0-3,6` -> [0, 1, 2, 3, 6]."""
    cpus: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"RANKCAST_CPU_BIND: {text!r} is not a CPU list like 0-3,6")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def cpus_for_rank(
    local_rank: int,
    ranks_on_this_machine: int,
    own_process: bool,
    setting: str = "auto",
    num_threads: int | None = None,
) -> list[int] | None:
    """The cores this rank's threads are bound to, or None to leave them to the OS.

    `setting` is the engine's RANKCAST_CPU_BIND (`ParallelConfig.cpu_bind`): automatic binding
    gives machine-local rank i the i-th equal slice of the allowed cores, and only in a process
    rankcast started: binding the threads of a caller's own process (the offline engine runs in
    it) would pin the caller's code too.
    """
    if setting == "off":
        return None
    if setting != "auto":
        lists = setting.split("|")
        if len(lists) < ranks_on_this_machine:
            raise ValueError(
                f"RANKCAST_CPU_BIND gives {len(lists)} CPU list(s) for "
                f"{ranks_on_this_machine} ranks on this machine"
            )
        return parse_cpu_list(lists[local_rank])
    if not own_process:
        return None
    cores = sorted(os.sched_getaffinity(0))
    per = threads_per_rank(ranks_on_this_machine, num_threads)
    first = local_rank * per
    return cores[first : first + per] if first + per <= len(cores) else None


def threads_per_rank(ranks_on_this_machine: int, explicit: int | None = None) -> int:
    """Share the cores evenly so ranks do not oversubscribe them (unless the engine was told
    how many each rank takes: `ParallelConfig.num_threads`)."""
    if explicit:
        return explicit
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, ranks_on_this_machine))
