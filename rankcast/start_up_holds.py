"""Start-up holds: a fault test's way to stop a process at an exact moment of its start.

The moments where a fleet's start is fragile (an engine core's KV commit, an API server
waiting for its handshake) last milliseconds, so a test that kills a process "during" one by
timing hits it only by luck. Where `RANKCAST_START_UP_HOLDS` names a directory, a process that
reaches a named point looks there for a file `<role>@<point>` (its role as its title says,
`engine_core_dp0`, `api_server_1`, `worker_dp0_pp0_tp1`). If the file is there, the process
removes it, so that a hold is one-shot and the process started in its place passes, and
stops itself with SIGSTOP. The test sees the stopped state in `/proc`, kills whichever process
it means to, and resumes the held one with SIGCONT. Unset, a point costs one environment read.

A fault injector, allowed because no outside observer can produce these moments otherwise;
no user-facing behaviour depends on it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal

from rankcast import envs

logger = logging.getLogger(__name__)

ROLE_PREFIX = "rankcast::"


def hold_file_name(role: str, point: str) -> str:
    """The file that arms the hold of `role` at `point`."""
    return f"{role}@{point}"


def hold_here(point: str) -> None:
    """Stop this process (SIGSTOP) if a test armed a hold for its role at `point`."""
    directory = envs.start_up_holds_dir()
    if directory is None:
        return
    import setproctitle

    title = setproctitle.getproctitle()
    if not title.startswith(ROLE_PREFIX):
        return
    armed = directory / hold_file_name(title[len(ROLE_PREFIX) :], point)
    with contextlib.suppress(FileNotFoundError):
        armed.unlink()
        logger.warning("held at start-up point %r (a fault test's hold)", point)
        os.kill(os.getpid(), signal.SIGSTOP)
