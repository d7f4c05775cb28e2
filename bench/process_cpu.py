"""CPU time of a server's processes, by role, for the benchmarks that share two cores with it.

On the 2-core machines here a served stream's speed depends on more than the model: every
millisecond the API servers and the client spend per token is taken from the model's threads
(a decode step is a fork-join over both cores). So bench/serve.py reports, beside each figure,
the CPU time per output token of each role in the server's process tree and of the client (this
process), read from /proc before and after the run. Linux only; elsewhere the figures are absent.
"""

from __future__ import annotations

import os
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system seconds) of `pid`, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS


def _role(pid: int) -> str:
    """A process's role from its name: the engine core, an API server (Python or Rust), or
    the rest (rankcast's launcher; the whole of a server that is one process, llama-server)."""
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "rest"
    # /proc's names are cut at 15 characters: "rankcast::engin", "rankcast::api_s",
    # "rankcast-fronte" (the Rust API server).
    if "engin" in name:
        return "engine_core"
    if "api_s" in name or "front" in name:
        return "api_servers"
    return "rest"


def tree_cpu(root: int) -> dict[str, float]:
    """CPU seconds so far of `root` and every descendant, summed by role (see `_role`); the
    counts of processes that ended are lost, so take both readings while the server runs."""
    stats: dict[int, tuple[int, float]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None:
                stats[int(entry.name)] = stat
    members = {root}
    grew = True
    while grew:
        grew = False
        for pid, (parent, _) in stats.items():
            if parent in members and pid not in members:
                members.add(pid)
                grew = True
    totals: dict[str, float] = {}
    for pid in members:
        if pid in stats:
            role = _role(pid)
            totals[role] = totals.get(role, 0.0) + stats[pid][1]
    return totals


def client_cpu() -> float:
    """CPU seconds so far of this process (the benchmark's client)."""
    times = os.times()
    return times.user + times.system


def per_token_ms(
    before: dict[str, float], after: dict[str, float], client: float, tokens: int
) -> dict[str, float]:
    """Milliseconds of CPU per output token by role between two readings, and the client's."""
    if tokens <= 0:
        return {}
    out = {role: (after[role] - before.get(role, 0.0)) * 1e3 / tokens for role in after}
    out["client"] = client * 1e3 / tokens
    return out
