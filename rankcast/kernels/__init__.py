"""rankcast's own CPU kernels (`csrc/`), built once by `make` and loaded as `torch.ops.rankcast`.

A decode step in plain torch spends more time gathering every sequence's KV history into a dense
tensor and running a dozen small element-wise ops per layer than in its matmuls. These kernels
read the paged cache in place and fuse the element-wise steps. They are compiled for the CPU they
run on (`-march=native`), so each build is keyed by its sources, the torch version and the CPU's
feature flags: a checkout shared by different machines never loads a foreign build.

Without a built library (or with `RANKCAST_KERNELS=off`) the model runs its plain-torch path,
which is also what CUDA uses; `python -m rankcast.kernels.build` builds it. With
`RANKCAST_KERNELS_ISA=avx512-bf16`, `avx512` or `avx2` a build leaves out this CPU's newer
instructions, so one machine can build and test the code other CPU families run (each such build
is keyed apart).
"""

from __future__ import annotations

import hashlib
import logging
import platform
from collections.abc import Callable
from pathlib import Path

import torch

from rankcast import envs

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
LIBRARY_NAME = "rankcast_kernels"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno")
LDFLAGS = ("-fopenmp",)
# RANKCAST_KERNELS_ISA below `native`: what -march=native is narrowed by, so that this CPU builds
# (and the tests run) the code another family gets. Each level needs the flags it keeps.
_NO_AMX = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")
ISA_LEVELS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # (flags the CPU must have, compiler flags added)
    "native": ((), ()),
    # AVX512-BF16 without AMX (Zen 4/5, Cooper Lake): on an AMX Xeon, the dot-product kernel its
    # native build replaces by tiles for bfloat16 (csrc/gemm_amx.cpp).
    "avx512-bf16": (("avx512_bf16",), _NO_AMX),
    # Skylake-SP: AVX-512 without BF16 or VNNI (int8 through VPMADDWD, csrc/gemm_int8.cpp).
    "avx512": (
        ("avx512f", "avx512bw"),
        ("-mno-avx512bf16", "-mno-avx512fp16", "-mno-avx512vnni", "-mno-avxvnni", *_NO_AMX),
    ),
    "avx2": (
        ("avx2", "fma"),
        ("-mno-avx512f", "-mno-avx512bf16", "-mno-avx512fp16", "-mno-avxvnni", *_NO_AMX),
    ),
}


# Choices measured to differ between Intel's and AMD's memory systems, by /proc/cpuinfo's
# vendor_id (docs/cpu-paths.md). A decode tile's read-ahead (csrc/gemm.h, `prefetch_ahead`) is
# non-temporal on AMD, as measured on Zen 5, and PREFETCHT0 on Intel: on an Emerald Rapids Xeon
# (2 pinned cores) non-temporal lines left the single-row linears 1.4-2.5x slower than
# PREFETCHT0, and a single stream ran at 35.6 against 60.6 tok/s end to end. A decode tile's
# fetch of the next column group (`prefetch_next`) goes to L2 only (PREFETCHT2) on both: measured
# faster on a Zen 4 and then on a Sapphire Rapids Xeon (q8_0's decode step 1.13-1.17x, q4_1's
# 1.03x, 1.13x at 4 rows), so it is no vendor choice. A batch tile's fetch of the next group
# is: PREFETCHT0 on AMD (T2 ~1 % slower at 32 rows on a Zen 4), PREFETCHT2 on Intel (the
# Sapphire Rapids Xeon's step at 32 rows 1.01-1.05x faster, float32 at 8 rows 1.13x). And an
# AVX512-BF16 build multiplies bfloat16 pairs on float32 FMAs on Intel (csrc/gemm.cpp,
# `tile_pairs_fma`: the same bits as VDPBF16PS): on an Emerald Rapids Xeon VDPBF16PS issued one
# every ~0.8 ns against an FMA every ~0.2 ns, and SmolLM2's bfloat16 decode step at 32 rows went
# 65.9 -> 45.0 ms; on AMD's Zen 4 the instruction is as fast as two FMAs and stays.
VENDOR_CFLAGS: dict[str, tuple[str, ...]] = {
    "GenuineIntel": (
        "-DRANKCAST_DECODE_PREFETCH_LOCALITY=3",
        "-DRANKCAST_BATCH_NEXT_LOCALITY=1",
        "-DRANKCAST_BF16_PAIRS_ON_FMA=1",
    ),
}


def cflags(isa: str | None = None, vendor: str | None = None) -> tuple[str, ...]:
    """The compiler flags of the build for RANKCAST_KERNELS_ISA (`isa`, default the
    environment's) on a CPU of `vendor` (default this one's)."""
    chosen = ISA_LEVELS[envs.kernels_isa() if isa is None else isa][1]
    return CFLAGS + chosen + VENDOR_CFLAGS.get(cpu_vendor() if vendor is None else vendor, ())


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD), or "" where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith("vendor_id"):
            return line.split(":", 1)[1].strip()
    return ""


def isa_runs_here(isa: str) -> bool:
    """Whether this CPU has every instruction a build for `isa` may use."""
    needed = ISA_LEVELS[isa][0]
    flags = set(cpu_fingerprint().split())
    return all(flag in flags for flag in needed)


def sources() -> list[Path]:
    return sorted(SOURCE_DIR.glob("*.cpp"))


def cpu_fingerprint() -> str:
    """What `-march=native` compiled for: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() + platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    lines = {line.split(":", 1)[0].strip(): line for line in text.splitlines() if ":" in line}
    return "\n".join(lines.get(key, "") for key in wanted)


def build_key() -> str:
    digest = hashlib.sha256()
    for path in sorted(SOURCE_DIR.iterdir()):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    for part in (torch.__version__, " ".join(cflags()), " ".join(LDFLAGS), cpu_fingerprint()):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def build_dir() -> Path:
    """Next to the sources (ignored by git), so that every process of this checkout finds the
    same build whatever cache directory it is told to use for weights."""
    return Path(__file__).parent / "build" / build_key()


def built_library_path() -> Path:
    """Where this checkout's sources are built for this machine (`python -m
    rankcast.kernels.build`)."""
    return build_dir() / f"{LIBRARY_NAME}.so"


def library_path() -> Path:
    """The build this process loads: this checkout's, or RANKCAST_KERNELS_LIBRARY's."""
    chosen = envs.kernels_library()
    return Path(chosen) if chosen is not None else built_library_path()


# The process's one decision (a loaded library cannot be unloaded): made by the first `load`.
_decision: list[tuple[str, bool]] = []


def load(mode: str | None = None) -> bool:
    """Whether the kernels are used in this process, loading them into torch the first time.

    `mode` is the engine's RANKCAST_KERNELS as settled in its configuration
    (`ParallelConfig.kernels`); every rank passes it before its model is built, so the first
    call, which decides for the process, is the engine's. Code outside an engine that asks first
    (the kernels' own tests) gets the environment's setting.
    """
    if not _decision:
        chosen = envs.kernels_mode() if mode is None else mode
        _decision.append((chosen, _load(chosen)))
    decided, loaded = _decision[0]
    if mode is not None and mode != decided:
        logger.warning(
            "RANKCAST_KERNELS=%s asked for, but this process already decided %s (loaded: %s)",
            mode,
            decided,
            loaded,
        )
    return loaded


def _load(mode: str) -> bool:
    if mode == "off":
        return False
    isa = envs.kernels_isa()
    if not isa_runs_here(isa):
        raise RuntimeError(f"RANKCAST_KERNELS_ISA={isa}: this CPU lacks what such a build uses")
    path = library_path()
    if envs.kernels_library() is not None and not path.exists():
        raise RuntimeError(f"RANKCAST_KERNELS_LIBRARY={path}: no such file")
    if not path.exists():
        message = (
            f"rankcast's CPU kernels are not built for this machine ({path}); running the "
            "slower plain-torch path. Build them with `make` or `python -m rankcast.kernels.build`."
        )
        if mode == "require":
            raise RuntimeError(message)
        logger.warning(message)
        return False
    # torch.ops.load_library has no annotations; it takes the library's path and returns None.
    load_library: Callable[[str], None] = torch.ops.load_library
    load_library(str(path))
    return True


def available(tensor: torch.Tensor) -> bool:
    """Whether the kernels can take this tensor: built, on the CPU, float32 or bfloat16."""
    return (
        tensor.device.type == "cpu" and tensor.dtype in (torch.float32, torch.bfloat16) and load()
    )
