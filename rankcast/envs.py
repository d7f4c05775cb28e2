"""Every environment variable rankcast reads, in one place.

Reading the environment anywhere else would hide configuration from a newcomer; this module is
the single list of knobs that do not come from CLI flags.

Each reader validates its variable and raises `ValueError` naming it, so that a bad value is
reported as "RANKCAST_X must be ..." rather than as a bare parse error. The variables that
configure an engine are read when its configuration is built (`rankcast/config.py`), so a bad
value stops `rankcast serve` at start instead of a worker after the model has loaded.
"""

from __future__ import annotations

import logging
import math
import os
import re
from pathlib import Path

# One element of a CPU list (`0-3,6` has two): a CPU or a range, as `platform.parse_cpu_list`
# reads them.
_CPU_RANGE = re.compile(r"\d+(-\d+)?")


def _non_negative(name: str, kind: type[int] | type[float]) -> int | float | None:
    """The variable as a finite number >= 0; None when unset or empty."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        number = kind(value)
    except ValueError:
        number = -1
    if number < 0 or not math.isfinite(number):
        noun = "an integer" if kind is int else "a number"
        raise ValueError(f"{name} must be {noun} >= 0, got {value!r}")
    return number


def cache_dir() -> Path:
    """Where converted weights live; a second start reuses them instead of dequantizing."""
    explicit = os.environ.get("RANKCAST_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "rankcast"


def log_level() -> str:
    """Root log level for rankcast's loggers (INFO unless told otherwise)."""
    value = os.environ.get("RANKCAST_LOG_LEVEL", "INFO").upper()
    if value not in logging.getLevelNamesMapping():
        raise ValueError(f"RANKCAST_LOG_LEVEL must be a logging level like INFO, got {value!r}")
    return value


def num_threads() -> int | None:
    """Torch intra-op threads per rank; None (unset, empty or 0) means "let rankcast choose
    from the core count"."""
    count = _non_negative("RANKCAST_NUM_THREADS", int)
    return int(count) if count else None


def kv_cache_space_gib() -> float | None:
    """CPU KV-cache budget override in GiB, as production engines' CPU builds accept it; None
    (unset, empty or 0) means rankcast's default."""
    gib = _non_negative("RANKCAST_KV_CACHE_SPACE", float)
    return float(gib) if gib else None


def weight_snapshots() -> bool:
    """Whether ranks save their loaded, packed weights once and map them on later starts
    (rankcast/model/weight_snapshot.py); RANKCAST_WEIGHT_SNAPSHOTS=0 turns that off."""
    value = os.environ.get("RANKCAST_WEIGHT_SNAPSHOTS", "1").strip().lower()
    if value not in ("", "0", "1", "false", "true", "off", "on"):
        raise ValueError(f"RANKCAST_WEIGHT_SNAPSHOTS must be 0 or 1, got {value!r}")
    return value not in ("0", "false", "off")


WEIGHT_SNAPSHOT_CACHE_GIB = 20.0  # weight_snapshot_cache_gib's default


def weight_snapshot_cache_gib() -> float:
    """The most the weight snapshots in the cache may take together, in GiB, from
    RANKCAST_WEIGHT_SNAPSHOT_CACHE_GIB (default 20): writing one first removes the least
    recently used others until it fits beside the rest, and one larger than the whole budget is
    not written (0: none is). Each kernel build, dtype, quantization and rank layout has a
    snapshot of its own, so without a bound a machine that rebuilds or tries layouts fills its
    disk with copies of one model."""
    gib = _non_negative("RANKCAST_WEIGHT_SNAPSHOT_CACHE_GIB", float)
    return WEIGHT_SNAPSHOT_CACHE_GIB if gib is None else float(gib)


def kv_cache_commit() -> bool:
    """Whether each rank writes every page of its KV cache at start, so the memory is the
    process's from then on (a machine that cannot hold it fails at start, not under load);
    RANKCAST_KV_CACHE_COMMIT=0 leaves pages to be taken as blocks are first written (a faster
    start, memory that grows with use)."""
    value = os.environ.get("RANKCAST_KV_CACHE_COMMIT", "1").strip().lower()
    if value not in ("", "0", "1", "false", "true", "off", "on"):
        raise ValueError(f"RANKCAST_KV_CACHE_COMMIT must be 0 or 1, got {value!r}")
    return value not in ("0", "false", "off")


def disable_progress() -> bool:
    """Hide load progress bars (tests and CI logs stay readable)."""
    return os.environ.get("RANKCAST_DISABLE_PROGRESS", "0") not in ("", "0", "false", "False")


def ray_address() -> str | None:
    """The Ray cluster the `ray` executor joins (None: Ray's own default, RAY_ADDRESS or local)."""
    return os.environ.get("RANKCAST_RAY_ADDRESS") or None


def worker_notification_poll_interval() -> float | None:
    """Seconds between notification polls when --worker-notification-poll-interval is not given.

    Unset, empty or 0 means no polling (the doorbell alone decides when to gather).
    """
    seconds = _non_negative("RANKCAST_WORKER_NOTIFICATION_POLL_INTERVAL", float)
    return float(seconds) if seconds else None


def restart_backoff_s() -> tuple[float, ...] | None:
    """The launcher's waits before restarting a dead engine core, in seconds, one per recent
    failure (`1,2,4`: 1 s after the first, 2 s after the second; the last repeats), from
    RANKCAST_RESTART_BACKOFF_S; None (unset or empty): the default, 1 s then 2 s
    (rankcast/launcher/supervision.py). Shorter where a restart is cheap and a dead engine
    costs more than a crash loop (and in the test suite, which restarts engines dozens of
    times); the give-up rule (three failures in five minutes) is the same whatever the waits."""
    value = os.environ.get("RANKCAST_RESTART_BACKOFF_S", "").strip()
    if not value:
        return None
    try:
        waits = tuple(float(part) for part in value.split(","))
    except ValueError:
        waits = (-1.0,)
    if not all(math.isfinite(wait) and wait >= 0 for wait in waits):
        raise ValueError(
            f"RANKCAST_RESTART_BACKOFF_S must be seconds >= 0, comma-separated (like 1,2,4), "
            f"got {value!r}"
        )
    return waits


def cpu_bind() -> str:
    """How each rank's OpenMP threads are pinned to cores: `auto` (the default: a rank in a
    process rankcast started gets its own slice of the allowed cores), `off`, or one CPU list per
    machine-local rank, `|`-separated (`0-3|4-7`), which also applies in the caller's process.

    Only the syntax is checked here; whether there is a list for every rank is checked against
    the configuration (`rankcast/config.py`)."""
    value = os.environ.get("RANKCAST_CPU_BIND", "").strip() or "auto"
    if value in ("auto", "off"):
        return value
    for cpus in value.split("|"):
        if not all(_CPU_RANGE.fullmatch(part.strip()) for part in cpus.split(",")):
            raise ValueError(
                f"RANKCAST_CPU_BIND must be auto, off or CPU lists like 0-3|4-7, got {value!r}"
            )
    return value


def kernels_mode() -> str:
    """Whether the model uses rankcast's built CPU kernels: `auto` (when built), `off` (plain
    torch, e.g. to compare), or `require` (fail instead of falling back)."""
    value = os.environ.get("RANKCAST_KERNELS", "auto").lower() or "auto"
    if value not in ("auto", "off", "require"):
        raise ValueError(f"RANKCAST_KERNELS must be auto, off or require, got {value!r}")
    return value


def linear_kernel() -> str:
    """Which matmul every linear layer runs (rankcast/model/linear_kernels.py): `auto` (the
    default: rankcast's packed kernel wherever it is built for the dtype, batch-invariant),
    `rankcast`, `onednn` (oneDNN's prepacked matmul: a request's results then depend on its
    batch; on an AMX CPU faster than rankcast's tiles only for prompts of hundreds of rows),
    `rows` (rankcast's kernel for steps of few rows, oneDNN's for many: results dependent on the
    batch) or `torch` (plain F.linear)."""
    value = os.environ.get("RANKCAST_LINEAR_KERNEL", "auto").strip().lower() or "auto"
    if value not in ("auto", "rankcast", "onednn", "rows", "torch"):
        raise ValueError(
            f"RANKCAST_LINEAR_KERNEL must be auto, rankcast, onednn, rows or torch, got {value!r}"
        )
    return value


def kernels_library() -> str | None:
    """A build of rankcast's CPU kernels to load instead of the one made for this checkout's
    sources: the path of its `rankcast_kernels.so`, so that two builds of the kernels (before
    and after a change) can be compared in one benchmark (`bench/decode_step.py --libraries`).
    Unset: the build for these sources and this machine."""
    return os.environ.get("RANKCAST_KERNELS_LIBRARY", "").strip() or None


def kernels_isa() -> str:
    """The instruction set rankcast's CPU kernels are compiled for: `native` (the default:
    everything this CPU has), or a lower level this CPU also runs, `avx512-bf16` (without AMX),
    `avx512` (AVX-512 without BF16, AMX or FP16) or `avx2` (AVX2 and FMA only), so that one
    machine can build and test the code paths other CPU families take
    (rankcast/kernels/__init__.py)."""
    value = os.environ.get("RANKCAST_KERNELS_ISA", "native").strip().lower() or "native"
    levels = ("native", "avx512-bf16", "avx512", "avx2")
    if value not in levels:
        raise ValueError(f"RANKCAST_KERNELS_ISA must be one of {levels}, got {value!r}")
    return value


def start_up_holds_dir() -> Path | None:
    """A directory of one-shot start-up holds (`rankcast/start_up_holds.py`), for fault tests
    that must kill a process at an exact moment of a fleet's start; unset (always, outside such
    tests) nothing is ever held."""
    value = os.environ.get("RANKCAST_START_UP_HOLDS", "").strip()
    return Path(value) if value else None
