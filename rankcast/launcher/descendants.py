"""How the launcher leaves nothing behind: every process it started, directly or through the
engine cores, executors and ranks, is reaped before it returns.

Linux re-parents an orphan to the nearest ancestor marked as a child subreaper, so the launcher
marks itself one (`adopt_orphans`): a rank whose engine core died before it, or the Rust API
server behind its Python starter, becomes the launcher's child and can be waited for. While it
supervises, the launcher reaps such adopted processes once they exit (`reap_adopted`), never
its own `multiprocessing` children, whose objects wait for themselves. At the end, after every
child was stopped and joined, `reap_everything` stops multiprocessing's resource tracker (the
launcher's spawn context started it; left alone it outlives the launcher by a moment, a
`<defunct>` in the launcher's process group) and waits for every remaining child, killing what
does not end in time. A supervisor that checks the group when the launcher exits finds it
empty.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
from collections.abc import Collection

from rankcast.process import process_table

logger = logging.getLogger(__name__)

_PR_SET_CHILD_SUBREAPER = 36


def adopt_orphans() -> bool:
    """Make orphaned descendants this process's children (Linux); False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)


def _children() -> dict[int, str]:
    """This process's children and their states (R, S, Z, ...), from /proc."""
    me = os.getpid()
    return {p.pid: p.state for p in process_table() if p.parent == me}


def reap_adopted(own: Collection[int]) -> int:
    """Reap adopted children that have exited; `own`: pids whose objects wait for them (this
    process's `multiprocessing` children), never touched. Returns how many were reaped."""
    reaped = 0
    for pid, state in _children().items():
        if state == "Z" and pid not in own:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
                reaped += 1
    return reaped


def stop_resource_tracker() -> None:
    """Stop multiprocessing's resource tracker if this process started it, and wait for it."""
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker  # the one this process started, if any
    with contextlib.suppress(Exception):
        tracker._stop()  # type: ignore[attr-defined]  # no public way to stop it


def reap_everything(timeout_s: float = 10.0) -> list[int]:
    """Wait until this process has no child left (adopted ones included), killing whatever is
    still alive after `timeout_s`; the pids that had to be killed. Call it only once every
    `multiprocessing` child has been joined: it waits for any child."""
    stop_resource_tracker()
    deadline = time.monotonic() + timeout_s
    killed: list[int] = []
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return killed  # no child at all
        if pid:
            continue
        if time.monotonic() >= deadline:
            for child in _children():
                logger.warning("process %d outlived its parent's stop; killing it", child)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
                killed.append(child)
            deadline = float("inf")  # killed: now wait for them without a limit
        time.sleep(0.01)
