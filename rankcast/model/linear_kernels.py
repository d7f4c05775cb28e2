"""Which matmul every linear layer of a model runs: the one place that choice is made.

A linear can run through rankcast's packed kernel (csrc/gemm.cpp), oneDNN's prepacked matmul,
or plain `F.linear`. The choice is made once per model (per dtype and device), from what the CPU
and the kernel build can do and the engine's `RANKCAST_LINEAR_KERNEL`; never per step and never
from what a cache holds, because two rules depend on it:

- **Batch invariance.** rankcast's packed kernel sums every output in the same order whatever
  the number of rows (tiles and row blocks only change the order of work), so a request's
  logits are bitwise the same alone, in any batch, chunked, or after a cached prefix. oneDNN and
  the BLAS behind `F.linear` choose their blocking, and so their order of summation, by the
  number of rows: the same request gives other bits in another batch (measured on an AMX Xeon:
  8 of 12 greedy chats changed text between a batch of 32 and running alone). A kernel chosen per
  batch size would break it the same way, so the choice is per model.
- **Warm starts.** A weight snapshot holds rankcast's packed layout; it is used only where the
  packed kernel is the chosen path (`weight_snapshot.py`), so a start's path never depends on
  what an earlier start left in the cache.

`auto` is rankcast's kernel wherever it is built for the dtype: every x86 family with AVX2 and FMA
(AVX2 only, AVX-512 without BF16, AVX512-BF16, AMX); `docs/cpu-paths.md` has the table with the
measurements behind it. On an AMX build rankcast's kernel multiplies bfloat16 on AMX tiles at
every row count (csrc/gemm_amx.cpp), faster than oneDNN's tiles in a batch and on a single
stream. `RANKCAST_LINEAR_KERNEL=onednn` forces oneDNN (batch-dependent results), and `rows`
keeps both packings and picks by the step's rows (rankcast's kernel below `ROWS_SPLIT`,
oneDNN's from there; measured when rankcast had no tiles: on an AMX build it now gains only
on prompts of hundreds of rows): results dependent on the batch, no weight snapshots (oneDNN's
packing is made at every start), the weights in memory twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rankcast import kernels
from rankcast.model.quantization import FOUR_BIT

LINEAR_KERNELS = ("auto", "rankcast", "onednn", "rows", "torch")

# `rows`: a step of fewer rows than this runs rankcast's kernel, a larger one oneDNN's. Measured
# per shape on an Emerald Rapids Xeon (2 cores, bfloat16, SmolLM2's projections and LM head,
# docs/cpu-paths.md): rankcast's kernel 1.7-3.6x faster at 4 rows, oneDNN's AMX tiles 1.1-2.0x at
# 16; between them the kernel's time grows with the rows and the tiles' stays flat, crossing at
# ~8 rows for the attention projections and ~12 for the MLP and the head.
ROWS_SPLIT = 8


@dataclass(frozen=True)
class CpuFacts:
    """What the choice depends on, gathered once: the CPU's family, whether this kernel build
    has a packed matmul for each dtype, and whether oneDNN can pack each dtype here."""

    family: str  # "amx", "avx512-bf16", "avx512", "avx2" or "other" (see `cpu_family`)
    packed: frozenset[torch.dtype]  # dtypes rankcast's loaded kernel build multiplies
    onednn: frozenset[torch.dtype]  # dtypes oneDNN packs on this CPU
    w8a8: str = "none"  # the loaded build's W8A8 kernel: "avx512-vnni", "avx512bw", "avx2", "none"
    q4: bool = False  # whether the loaded build has the 4-bit kernel
    q8: bool = False  # whether the loaded build has the 8-bit group kernel
    # the loaded build's instructions (`build_isa`): "amx" multiplies bfloat16 on AMX tiles
    build: str = ""

    @classmethod
    def of_this_machine(cls) -> CpuFacts:
        dtypes = (torch.float32, torch.bfloat16)
        packed: frozenset[torch.dtype] = frozenset()
        w8a8, q4, q8, build = "none", False, False, ""
        if kernels.load():
            supported: Callable[[torch.dtype], bool] = torch.ops.rankcast.packed_linear_supported
            packed = frozenset(d for d in dtypes if supported(d))
            w8a8_path: Callable[[], str] = torch.ops.rankcast.w8a8_path
            w8a8 = w8a8_path()
            q4_supported: Callable[[], bool] = torch.ops.rankcast.q4_supported
            q4 = q4_supported()
            q8_supported: Callable[[], bool] = torch.ops.rankcast.q8_supported
            q8 = q8_supported()
            build_isa: Callable[[], str] = torch.ops.rankcast.build_isa
            build = build_isa()
        mkldnn_available: Callable[[], bool] = torch.backends.mkldnn.is_available
        onednn: frozenset[torch.dtype] = frozenset()
        if mkldnn_available():
            onednn = frozenset(d for d in dtypes if d == torch.float32 or onednn_packs_bf16())
        return cls(cpu_family(), packed, onednn, w8a8, q4, q8, build)


@dataclass(frozen=True)
class LinearPath:
    """The chosen path: which kernel, whether a request's results are then independent of the
    batch it runs in, and why it was chosen (for the start-up log)."""

    kernel: str  # "rankcast", "onednn", "rows" (both packed, by the step's rows) or "torch"
    batch_invariant: bool
    reason: str

    def describe(self) -> str:
        invariant = "batch-invariant" if self.batch_invariant else "NOT batch-invariant"
        return f"{self.kernel} ({invariant}: {self.reason})"


def onednn_packs_bf16() -> bool:
    """oneDNN packs bfloat16 weights only with AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; asked for
    bfloat16 on an AVX2-only CPU it refuses, and plain `F.linear` runs instead."""
    supported: Callable[[], bool] = torch.ops.mkldnn._is_mkldnn_bf16_supported
    return bool(supported())


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as the kernel reports them (empty where /proc/cpuinfo is not)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_family(flags: frozenset[str] | None = None) -> str:
    """The x86 family, by the instructions that decide the matmul paths: AMX tiles,
    AVX512-BF16 dot products, AVX-512 without them, AVX2 with FMA, or none of these."""
    flags = cpu_flags() if flags is None else flags
    if "amx_bf16" in flags and "amx_tile" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512-bf16"
    if "avx512f" in flags and "avx512bw" in flags:
        return "avx512"
    if "avx2" in flags and "fma" in flags:
        return "avx2"
    return "other"


def choose_linear_path(
    dtype: torch.dtype,
    device: torch.device,
    setting: str = "auto",
    facts: CpuFacts | None = None,
    quantization: str = "none",
) -> LinearPath:
    """The path every linear of a `dtype` model on `device` takes, under the engine's
    `RANKCAST_LINEAR_KERNEL` (`setting`) and `--quantization`. Raises ValueError naming the
    setting where a forced path cannot run here. `facts` defaults to this machine's (tests pass
    other families')."""
    if setting not in LINEAR_KERNELS:
        raise ValueError(f"RANKCAST_LINEAR_KERNEL must be one of {LINEAR_KERNELS}, got {setting!r}")
    if quantization != "none":
        return _quantized_path(dtype, device, setting, facts, quantization)
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        if setting not in ("auto", "torch"):
            raise ValueError(
                f"RANKCAST_LINEAR_KERNEL={setting} runs on the CPU in float32 or bfloat16 only, "
                f"not {device.type} {dtype}"
            )
        return LinearPath("torch", False, f"F.linear on {device.type} {dtype}")
    facts = CpuFacts.of_this_machine() if facts is None else facts
    name = str(dtype).removeprefix("torch.")
    if setting == "torch":
        return LinearPath("torch", False, "forced by RANKCAST_LINEAR_KERNEL")
    if setting == "onednn":
        if dtype not in facts.onednn:
            raise ValueError(
                f"RANKCAST_LINEAR_KERNEL=onednn: oneDNN cannot pack {name} weights on this CPU"
            )
        return LinearPath("onednn", False, "forced by RANKCAST_LINEAR_KERNEL")
    if setting == "rows":
        if dtype not in facts.packed or dtype not in facts.onednn:
            missing = "rankcast's kernel build" if dtype not in facts.packed else "oneDNN"
            raise ValueError(
                f"RANKCAST_LINEAR_KERNEL=rows needs both matmuls for {name} weights, and "
                f"{missing} has none on this CPU"
            )
        why = (
            f"rankcast's kernel below {ROWS_SPLIT} rows a step, oneDNN's from {ROWS_SPLIT}: "
            "forced by RANKCAST_LINEAR_KERNEL"
        )
        return LinearPath("rows", False, why)
    if dtype in facts.packed:
        why = _why_rankcast(facts, dtype)
        if setting == "rankcast":
            why = f"forced by RANKCAST_LINEAR_KERNEL; {why}"
        return LinearPath("rankcast", True, why)
    if setting == "rankcast":
        raise ValueError(
            f"RANKCAST_LINEAR_KERNEL=rankcast: this kernel build has no packed {name} matmul "
            "(kernels off or not built, or a CPU without AVX2 and FMA)"
        )
    if dtype in facts.onednn:
        return LinearPath("onednn", False, f"no packed {name} kernel in this build")
    return LinearPath("torch", False, f"neither rankcast's kernel nor oneDNN packs {name} here")


def _quantized_path(
    dtype: torch.dtype, device: torch.device, setting: str, facts: CpuFacts | None, scheme: str
) -> LinearPath:
    """Quantized weights: rankcast's kernel wherever it is built (weight-only "int8" through
    the float kernels of csrc/gemm.cpp, "w8a8" through csrc/gemm_w8a8.cpp, "q4_0" and
    "q4_1" through csrc/gemm_q4.cpp, "q8_0" through csrc/gemm_q8.cpp); torch's reference
    arithmetic elsewhere (CUDA, kernels off)."""
    if setting in ("onednn", "rows"):
        raise ValueError(
            f"RANKCAST_LINEAR_KERNEL={setting} has no {scheme} path; --quantization {scheme} "
            "runs rankcast's kernel (or torch)"
        )
    on_cpu = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
    if on_cpu and setting != "torch":
        facts = CpuFacts.of_this_machine() if facts is None else facts
        if scheme == "int8" and dtype in facts.packed:
            if facts.build == "amx" and dtype == torch.bfloat16:
                how = "int8 weights converted to bfloat16 tile by tile (a column group "
                how += "at a time above 32 rows), then"
                return LinearPath("rankcast", True, f"{how} {_why_rankcast(facts, dtype)}")
            why = f"int8 weights widened in registers, {_WHY[facts.family]}"
            return LinearPath("rankcast", True, why)
        if scheme == "w8a8" and facts.w8a8 != "none":
            why = f"int8 weights and rows (per token), exact int32 sums ({facts.w8a8})"
            return LinearPath("rankcast", True, why)
        if scheme in FOUR_BIT and facts.q4:
            why = "4-bit groups times 15-bit rows per token, exact int32 group sums"
            return LinearPath("rankcast", True, why)
        if scheme == "q8_0" and facts.q8:
            why = "8-bit groups times 15-bit rows per token, exact int32 group sums"
            return LinearPath("rankcast", True, why)
    if setting == "rankcast":
        raise ValueError(
            f"RANKCAST_LINEAR_KERNEL=rankcast: this kernel build has no {scheme} matmul "
            "(kernels off or not built, or a CPU without AVX2)"
        )
    return LinearPath("torch", False, f"{scheme} weights through torch on {device.type} {dtype}")


def _why_rankcast(facts: CpuFacts, dtype: torch.dtype) -> str:
    """Why rankcast's kernel is the path for `dtype` here, naming the tiles where an AMX build
    multiplies bfloat16 on them."""
    if facts.build == "amx" and dtype == torch.bfloat16:
        return (
            "AMX tiles at every row count (a single stream and a batch on one kernel, one order "
            "of summation) where K, rounded up to even, is a multiple of 32; other Ks on the "
            "AVX512-BF16 kernel"
        )
    return _WHY[facts.family]


_WHY = {
    "amx": "few-row decode reads the weights at ~93 % of the memory bandwidth (oneDNN's tiles "
    "~48 %) and sums in one order for every batch size",
    "avx512-bf16": "faster than oneDNN at every batch size measured (1.2-2.6x at decode sizes)",
    "avx512": "the same kernel as AVX512-BF16 CPUs, bfloat16 widened to float32 in registers",
    "avx2": "float32 FMAs over panels of two ymm registers; bfloat16 widened in registers",
    "other": "built for this CPU",
}
