"""Start-up holds: a fault test's way to stop a process at an exact moment of its start.

The moments where a fleet's start is fragile (an engine core's KV commit, an API server
waiting for its handshake) last milliseconds, so a test that kills a process "during" one by
timing hits it only by luck. Where `RANKCAST_START_UP_HOLDS` names a directory, a process that
reaches a named point looks there for a file `<role>@<point>` (its role as its title says,
`engine_core_dp0`, `api_server_1`, `worker_dp0_pp0_tp1`). If the file is there, the process
renames it to `<role>@<point>.held` (so a hold is one-shot: the process started in its place
passes) and the thread that reached the point waits until that file is gone. Only that thread
waits: the process's other threads go on, ZMQ's among them, so an engine core held before it
serves still takes its clients' hellos into its sockets, as a live engine would. The test sees
the `.held` file, kills whichever process it means to, and removes the file to let the held
thread go on. Unset, a point costs one environment read.

A fault injector, allowed because no outside observer can produce these moments otherwise;
no user-facing behaviour depends on it.
"""

from __future__ import annotations

import logging
import time

from rankcast import envs

logger = logging.getLogger(__name__)

ROLE_PREFIX = "rankcast::"
HELD_SUFFIX = ".held"
_POLL_S = 0.01


def hold_file_name(role: str, point: str) -> str:
    """The file that arms the hold of `role` at `point`."""
    return f"{role}@{point}"


def held_file_name(role: str, point: str) -> str:
    """The file that says `role` is held at `point`; removing it lets the process go on."""
    return f"{hold_file_name(role, point)}{HELD_SUFFIX}"


def hold_here(point: str) -> None:
    """Wait here, in this thread, if a test armed a hold for this process's role at `point`."""
    directory = envs.start_up_holds_dir()
    if directory is None:
        return
    import setproctitle

    title = setproctitle.getproctitle()
    if not title.startswith(ROLE_PREFIX):
        return
    role = title[len(ROLE_PREFIX) :]
    held = directory / held_file_name(role, point)
    try:
        (directory / hold_file_name(role, point)).rename(held)
    except FileNotFoundError:
        return
    logger.warning("held at start-up point %r (a fault test's hold)", point)
    while held.exists():
        time.sleep(_POLL_S)
