"""Every environment variable rankcast reads, in one place.

Reading the environment anywhere else would hide configuration from a newcomer; this module is
the single list of knobs that do not come from CLI flags.
"""

from __future__ import annotations

import os
from pathlib import Path


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
    return os.environ.get("RANKCAST_LOG_LEVEL", "INFO").upper()


def num_threads() -> int | None:
    """Torch intra-op threads per process; None means "let rankcast choose from the core count"."""
    value = os.environ.get("RANKCAST_NUM_THREADS")
    return int(value) if value else None


def kv_cache_space_gib() -> float | None:
    """CPU KV-cache budget override in GiB, as production engines' CPU builds accept it."""
    value = os.environ.get("RANKCAST_KV_CACHE_SPACE")
    return float(value) if value else None


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
    value = os.environ.get("RANKCAST_WORKER_NOTIFICATION_POLL_INTERVAL")
    if not value:
        return None
    seconds = float(value)
    if seconds < 0:
        raise ValueError(
            f"RANKCAST_WORKER_NOTIFICATION_POLL_INTERVAL must be >= 0 seconds, got {value!r}"
        )
    return seconds or None


def cpu_bind() -> str:
    """How each rank's OpenMP threads are pinned to cores: `auto` (the default: a rank in a
    process rankcast started gets its own slice of the allowed cores), `off`, or one CPU list per
    machine-local rank, `|`-separated (`0-3|4-7`), which also applies in the caller's process."""
    return os.environ.get("RANKCAST_CPU_BIND", "").strip() or "auto"


def kernels_mode() -> str:
    """Whether the model uses rankcast's built CPU kernels: `auto` (when built), `off` (plain
    torch, e.g. to compare), or `require` (fail instead of falling back)."""
    value = os.environ.get("RANKCAST_KERNELS", "auto").lower() or "auto"
    if value not in ("auto", "off", "require"):
        raise ValueError(f"RANKCAST_KERNELS must be auto, off or require, got {value!r}")
    return value
