"""The kernel builds of the other CPU families (tests/model/test_cpu_families.py), started in
the background as soon as the suite has collected that file's tests.

On a clean clone those builds take about two minutes of compiling each, which the tests
waiting on them used to spend alone. Started at collection, each runs under SCHED_IDLE
(`chrt --idle 0`; `nice -n 19` where chrt is missing), so it takes only the CPU the rest of
the suite leaves idle (the many tests that wait on engine processes, sockets and servers), and
the tests that need them run last (tests/conftest.py), by when they are built. Niced by 10
instead, a build still slowed what ran beside it: the two-host Ray test's call took 24.3 s
beside one against 11.2 s alone, and 11.8 s beside one under SCHED_IDLE, which still finished
in 79 s (2-core Zen 4). A test that needs one waits for it (`finish`). Run outside the suite,
`finish` builds there and then, as before.
"""

from __future__ import annotations

import os
import shutil
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


def _idle_priority() -> list[str]:
    """The command prefix that runs a build only on otherwise idle CPU (its compilers inherit
    the policy)."""
    return ["chrt", "--idle", "0"] if shutil.which("chrt") else ["nice", "-n", "19"]


def start() -> None:
    """Start every family's build this CPU tests, at idle priority, in the background."""
    for isa in FAMILIES:
        if needed_here(isa) and isa not in _started and isa not in _finished:
            _started[isa] = subprocess.Popen(
                [*_idle_priority(), *_BUILD],
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
