"""Process-level helpers: titles operators can read, and no orphans when a parent dies."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import uuid
from dataclasses import dataclass
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


class TeardownSkip:
    """Lets a child process that finished cleanly end without the interpreter's teardown.

    With torch loaded, tearing down the modules of a process that has already closed
    everything it owns takes ~0.8 s on a 2-core machine, and a launcher stopping an engine
    core waits for all of it. Made before the heavy imports, its exit hook is among the first
    registered, so it runs after every later one (atexit runs newest first): those run, the
    streams are flushed, and `os._exit(0)` skips the rest. A process that did not finish
    cleanly (an exception, SystemExit(1)) exits the ordinary way.
    """

    def __init__(self) -> None:
        self.clean = False
        atexit.register(self._exit)

    def finished(self) -> None:
        """Everything this process owns is closed: it may end without the teardown."""
        self.clean = True

    def _exit(self) -> None:
        if not self.clean:
            return
        logging.shutdown()  # registered before this hook: it would not run after it
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(0)


def signal_wakeup() -> tuple[socket.socket, socket.socket]:
    """(readable end, written end) of a socket pair that a signal's arrival writes to
    (`signal.set_wakeup_fd`; a byte per signal that has a Python handler, its number): a loop
    waiting on sockets or pipes polls the readable end beside them and sees a stop at once,
    where a wait interrupted by the signal would only resume until its timeout. From the main
    thread; `end_signal_wakeup` undoes it."""
    readable, written = socket.socketpair()
    for end in (readable, written):
        end.setblocking(False)
    signal.set_wakeup_fd(written.fileno(), warn_on_full_buffer=False)
    return readable, written


def end_signal_wakeup(ends: tuple[socket.socket, socket.socket]) -> None:
    """Unset the wakeup fd before its socket closes (a late signal then writes nowhere)."""
    signal.set_wakeup_fd(-1)
    for end in ends:
        end.close()


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


@dataclass(frozen=True)
class ProcessEntry:
    """One process as /proc/<pid>/stat shows it: its state (R, S, Z, ...), parent and session."""

    pid: int
    state: str
    parent: int
    session: int


def process_table() -> list[ProcessEntry]:
    """Every process of the machine (Linux /proc); one that vanishes while read is left out."""
    entries = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        entries.append(ProcessEntry(int(entry.name), fields[0], int(fields[1]), int(fields[3])))
    return entries


STAGING_PREFIX = ".staging-"


def staging_name(name: str) -> str:
    """The name to write `name` under until it is whole (then renamed into place): it carries
    this process's pid, so that pruning can tell a writer that died from one still at work."""
    return f"{STAGING_PREFIX}{os.getpid()}-{name}"


def abandoned_staging(name: str) -> bool | None:
    """For a `staging_name`: whether the process writing it is gone. None for any other name."""
    if not name.startswith(STAGING_PREFIX):
        return None
    pid = name[len(STAGING_PREFIX) :].split("-", 1)[0]
    return not pid.isdigit() or not process_is_alive(int(pid))


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
