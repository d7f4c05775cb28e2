"""The standard benchmark workload and the machine facts every result carries.

`bench/prompts.json` is the workload every benchmark runs: 32 varied chat prompts, the model's
chat template applied, 128 output tokens each with EOS ignored, greedy. Absolute figures drift
between runs and machines, so each result records the CPU (model and the ISA features that pick
the kernels and the dtype) next to the numbers.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT / "bench" / "prompts.json"

Chat = list[dict[str, str]]
T = TypeVar("T")


def rates_by_batch(
    generate: Callable[[Sequence[T]], Sequence[Any]],
    items: Sequence[T],
    runs: int,
    sizes: Sequence[int],
) -> dict[int, list[float]]:
    """Generated tok/s of the first `size` items at once, `runs` times, for each of `sizes` in
    turn: `generate` takes a list of prompts (or chats) and returns their outputs."""

    def rate(batch: Sequence[T]) -> float:
        start = time.perf_counter()
        outs = generate(batch)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)

    return {size: [rate(items[:size]) for _ in range(runs)] for size in sizes}


def single_and_batch_rates(
    generate: Callable[[Sequence[T]], Sequence[Any]], items: Sequence[T], runs: int
) -> tuple[list[float], list[float]]:
    """Generated tok/s of the first item alone, then of all of them at once, `runs` times
    each (`rates_by_batch` at 1 and all)."""
    rates = rates_by_batch(generate, items, runs, (1, len(items)))
    return rates[1], rates[len(items)]


def load_prompts() -> tuple[list[str], int]:
    """The 32 prompts and the number of tokens each request generates."""
    data = json.loads(WORKLOAD.read_text())
    return list(data["prompts"]), int(data["output_tokens"])


def load_chats() -> tuple[list[Chat], int]:
    prompts, tokens = load_prompts()
    return [[{"role": "user", "content": p}] for p in prompts], tokens


def _cpuinfo() -> dict[str, str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def physical_cores(cpus: set[int]) -> int | None:
    """How many physical cores the logical CPUs `cpus` lie on, as sysfs tells it (None where it
    does not): two logical CPUs of one core (SMT siblings) share its execution units and caches,
    AMX tiles included, so "2 cores" measured on siblings is half the machine it sounds like."""
    cores: set[tuple[str, str]] = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            package = (topology / "physical_package_id").read_text().strip()
            core = (topology / "core_id").read_text().strip()
        except OSError:
            return None
        cores.add((package, core))
    return len(cores)


# Settings that move a figure without changing the code: how the worker's OpenMP threads wait
# between parallel regions (a single stream served halved with OMP_WAIT_POLICY=passive on a
# Zen 4) and how many there are and where they run. A result records those that were set.
TUNING_ENV = (
    "OMP_WAIT_POLICY",
    "GOMP_SPINCOUNT",
    "OMP_NUM_THREADS",
    "RANKCAST_NUM_THREADS",
    "RANKCAST_CPU_BIND",
    "RANKCAST_LINEAR_KERNEL",
    "RANKCAST_KERNELS_ISA",
)


def machine_info() -> dict[str, Any]:
    """CPU model, usable cores (and the physical cores under them) and the ISA features that
    matter for inference speed."""
    import torch

    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    isa = {
        "amx": "amx_tile" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "avx512": "avx512f" in flags,
        "avx2": "avx2" in flags,
    }
    best = next((name for name, present in isa.items() if present), platform.machine())
    return {
        "cpu": info.get("model name") or platform.processor() or platform.machine(),
        "cpu_family": info.get("cpu family"),
        "cpu_model": info.get("model"),
        "cores": len(os.sched_getaffinity(0)),
        "physical_cores": physical_cores(os.sched_getaffinity(0)),
        "isa": isa,
        "best_isa": best,
        "torch": torch.__version__,
        "env": {name: os.environ[name] for name in TUNING_ENV if name in os.environ},
    }


def describe(machine: dict[str, Any]) -> str:
    """One line for a table's heading: what the figures were measured on."""
    features = ", ".join(name for name, present in machine["isa"].items() if present) or "none"
    cores = f"{machine['cores']} cores"
    physical = machine.get("physical_cores")
    if physical is not None and physical < machine["cores"]:
        cores = f"{machine['cores']} logical CPUs on {physical} physical core(s)"
    settings = "".join(f"; {name}={value}" for name, value in machine.get("env", {}).items())
    return (
        f"{machine['cpu']} (family {machine['cpu_family']} model {machine['cpu_model']}), "
        f"{cores}, ISA: {features}; torch {machine['torch']}{settings}"
    )
