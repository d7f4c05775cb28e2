"""The kernel builds of the other CPU families (tests/model/test_cpu_families.py), started in
the background as soon as the suite has collected that file's tests.

On a clean clone those builds take about three minutes of compiling, which the tests waiting
on them used to spend alone. Started at collection, each runs niced (`nice -n 10`), so it takes
the CPU the rest of the suite leaves idle (the many tests that wait on engine processes,
sockets and servers) instead of adding its whole length to the run; a test that needs one waits
for it (`finish`). Run outside the suite, `finish` builds there and then, as before.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rankcast import kernels

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("avx512-bf16", "avx512", "avx2")
_BUILD = [sys.executable, "-m", "rankcast.kernels.build"]
_started: dict[str, subprocess.Popen[str]] = {}
_finished: dict[str, tuple[int, str]] = {}


def needed_here(isa: str) -> bool:
    """Whether this CPU tests `isa`'s build: it runs it, and it is not the CPU's own (an
    AVX512-BF16 build is another family's only on an AMX Xeon, whose own build uses tiles)."""
    if not kernels.isa_runs_here(isa):
        return False
    return isa != "avx512-bf16" or "amx_bf16" in kernels.cpu_fingerprint().split()


def _env(isa: str) -> dict[str, str]:
    return {**os.environ, "RANKCAST_KERNELS_ISA": isa, "RANKCAST_KERNELS": "require"}


def start() -> None:
    """Start every family's build this CPU tests, niced, in the background."""
    for isa in FAMILIES:
        if needed_here(isa) and isa not in _started and isa not in _finished:
            _started[isa] = subprocess.Popen(
                ["nice", "-n", "10", *_BUILD],
                cwd=ROOT,
                env=_env(isa),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )


def finish(isa: str) -> tuple[int, str]:
    """`isa`'s build, waited for (or run now if it was not started): (exit status, output,
    whose last line is the library's path)."""
    if isa not in _finished:
        process = _started.pop(isa, None)
        if process is None:
            run = subprocess.run(
                _BUILD, cwd=ROOT, env=_env(isa), capture_output=True, text=True, timeout=400
            )
            _finished[isa] = (run.returncode, run.stdout + run.stderr)
        else:
            try:
                output, _ = process.communicate(timeout=400)
            except subprocess.TimeoutExpired:
                process.kill()
                output, _ = process.communicate()
            _finished[isa] = (process.returncode, output)
    return _finished[isa]


def stop() -> None:
    """Stop builds no test waited for (a run interrupted or deselected after collection)."""
    for process in _started.values():
        process.kill()
        process.wait()
    _started.clear()
