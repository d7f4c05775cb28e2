"""Helpers for fleets with Rust API servers: run the binary built from this tree, find it,
kill it and wait for the launcher to start it again."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from rankcast.launcher.rust_api_server import BINARY_ENV
from tests.entrypoints.server_process import ServerProcess, descendants
from tests.rust_build import binary


def frontend_env() -> dict[str, str]:
    """The launcher runs the Rust server built from this tree now, never a stale release."""
    return {BINARY_ENV: str(binary("rankcast-frontend"))}


def frontend_pid(server: ServerProcess) -> int:
    """The running rankcast-frontend among the launcher's descendants."""
    for pid in descendants(server.proc.pid):
        try:
            name = Path(os.readlink(f"/proc/{pid}/exe")).name
        except OSError:  # gone meanwhile
            continue
        if name == "rankcast-frontend":
            return pid
    raise LookupError("no rankcast-frontend process")


def kill_and_wait_for_restart(server: ServerProcess, timeout_s: float = 60) -> int:
    """SIGKILL the Rust API server; the pid of the one the launcher starts in its place."""
    old = frontend_pid(server)
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while True:
        assert time.monotonic() < deadline, "the Rust API server was not restarted"
        try:
            new = frontend_pid(server)
        except LookupError:
            new = old
        if new != old:
            return new
        time.sleep(0.1)
