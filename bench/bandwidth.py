"""The machine's memory bandwidth as a decode step sees it: a streaming read on every core.

A single decode stream reads every weight once per token, so its ceiling is the memory
bandwidth divided by the bytes read per token. This probe sums a float32 buffer far larger than
the caches (1 GiB by default) with torch on every core this process may use, and reports the
best of a few repeats in GB/s (10^9 bytes per second). A sum does one add per 4 bytes read, far
less than the cores can do, so the figure is the memory's, not the arithmetic's.

    python bench/bandwidth.py [--gib 1] [--repeats 5] [--json]

`measure()` runs it in the calling process (it sets torch's thread count for the duration);
`probe()` runs it in a fresh interpreter, so that neither the buffer nor the threads touch the
caller (a benchmark with an engine loaded).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def measure(gib: float = 1.0, repeats: int = 5) -> dict[str, Any]:
    """Stream-read a `gib` GiB float32 buffer `repeats` times on every core; the best rate."""
    import torch

    threads = cores()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)  # touches every page
        buffer.sum()  # warm-up: thread pool up, pages mapped
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            buffer.sum()
            seconds.append(time.perf_counter() - start)
        size = buffer.numel() * buffer.element_size()
        del buffer
    finally:
        torch.set_num_threads(previous)
    rates = [size / s / 1e9 for s in seconds]
    return {
        "gb_per_s": max(rates),
        "runs_gb_per_s": rates,
        "buffer_bytes": size,
        "threads": threads,
        "method": "torch float32 sum (streaming read)",
    }


def probe(gib: float = 1.0, repeats: int = 5, timeout_s: float = 300.0) -> dict[str, Any]:
    """`measure()` in a fresh interpreter (the caller's memory and threads untouched)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--gib", str(gib)]
    done = subprocess.run(
        [*command, "--repeats", str(repeats), "--json"],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=1.0, help="buffer size in GiB")
    parser.add_argument("--repeats", type=int, default=5, help="timed reads (best kept)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    result = measure(args.gib, args.repeats)
    if args.json:
        print(json.dumps(result))
        return
    runs = ", ".join(f"{r:.1f}" for r in result["runs_gb_per_s"])
    print(
        f"memory bandwidth: {result['gb_per_s']:.1f} GB/s (best of {args.repeats} streaming "
        f"reads of {args.gib:g} GiB on {result['threads']} threads: {runs})"
    )


if __name__ == "__main__":
    main()
