"""Process-level helpers: titles operators can read, and no orphans when a parent dies."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys
import tempfile
import uuid
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def set_process_title(role: str) -> None:
    """Name the process `rankcast::<role>` so `ps` and `top` tell the roles apart."""
    import setproctitle

    setproctitle.setproctitle(f"rankcast::{role}")


def is_rankcast_process() -> bool:
    """Whether rankcast started this process (it named itself), rather than a caller's."""
    import setproctitle

    return setproctitle.getproctitle().startswith("rankcast::")


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies, so a killed launcher leaves none."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def process_is_alive(pid: int) -> bool:
    """True while `pid` runs; an exited process awaiting its parent (zombie) counts as dead."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        return True


def private_ipc_dir(prefix: str) -> Path:
    """A fresh directory only this user can enter, for IPC socket files. Its name carries the
    creating process's pid, so a parent can remove what a killed child could not."""
    path = Path(tempfile.gettempdir()) / f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    path.mkdir(mode=0o700)
    return path


def remove_ipc_dirs_of(pid: int, prefix: str = "rankcast") -> None:
    """Remove the IPC directories process `pid` made (it was killed before it could)."""
    for path in Path(tempfile.gettempdir()).glob(f"{prefix}*-{pid}-*"):
        shutil.rmtree(path, ignore_errors=True)
