"""What an operator sees when starting `rankcast serve` goes wrong, or when it is started again.

A child killed during start-up is started again like one killed later (test_start_up_kills.py);
one that keeps dying is given up on, and then the launch ends with one clear line naming the
role, the count and the last exit status; a restart on the same port right after a stop works
although the last run's connections are still in TIME_WAIT.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx
import pytest

from rankcast.launcher.fleet import Fleet, LaunchError, Role
from rankcast.launcher.supervision import Supervision
from tests.entrypoints.server_process import (
    TCP_TIME_WAIT,
    ServerProcess,
    assert_session_ends,
    free_port,
    launcher_while_loading,
    next_engine_core,
    sockets_on_port,
    tiny_model_args,
)


def test_a_restart_on_the_same_port_works_with_time_wait_sockets_present(
    tiny_llama_dir: Path,
) -> None:
    port = free_port()
    args = tiny_model_args(tiny_llama_dir)
    first = ServerProcess(*args, api_server_count=1, port=port)
    with first.running():
        # Connections the client keeps open: the server closes them when it stops, so the
        # TIME_WAIT state stays on the server's side, on its listening port.
        clients = [httpx.Client(timeout=30) for _ in range(4)]
        for client in clients:
            assert client.get(f"{first.url}/health").status_code == 200
    for client in clients:
        client.close()
    assert sockets_on_port(port, TCP_TIME_WAIT) > 0, "the test needs TIME_WAIT sockets on the port"
    second = ServerProcess(*args, api_server_count=1, port=port)
    with second.running():
        assert httpx.get(f"{second.url}/health", timeout=30).status_code == 200


def test_a_child_that_keeps_dying_during_start_up_ends_the_launch_in_one_clear_line() -> None:
    """Each death during the start is restarted (1 s, then 2 s of back-off); the third within
    five minutes, before the fleet ever served, ends the launch: nothing was promised to a
    client yet, and whoever started it must see the failure."""
    with launcher_while_loading() as (launcher, engine):
        for kill in range(3):
            os.kill(engine, signal.SIGKILL)
            if kill < 2:
                engine = next_engine_core(launcher, engine, timeout_s=30)
        _, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode != 0
    assert "Traceback" not in stderr and "EOFError" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("rankcast: error:")]
    assert errors == [
        "rankcast: error: engine core 0 failed 3 times within 300 s (last: exited during "
        "start-up (exit code -9)); the launcher does not restart it"
    ]
    assert_session_ends(launcher.pid)


def test_a_killed_engine_core_leaves_no_ipc_directory_behind(tiny_llama_dir: Path) -> None:
    server = ServerProcess(
        *tiny_model_args(tiny_llama_dir, "--tensor-parallel-size", "2"), api_server_count=1
    )
    with server.running():
        engine = server.pid_of("engine_core_dp0")
        workers = list(Path(tempfile.gettempdir()).glob(f"rankcast-workers-{engine}-*"))
        assert workers, "the engine core's ranks talk through an IPC directory of its own"
        os.kill(engine, signal.SIGKILL)  # it cannot remove anything itself
        # The launcher removes the directory once it sees the death (before it restarts the
        # engine core), while it keeps serving; no time in between is promised, so no check
        # that it was ever left behind.
        deadline = time.monotonic() + 30
        while any(path.exists() for path in workers):
            assert time.monotonic() < deadline, "the launcher did not remove the IPC directory"
            time.sleep(0.1)
        assert server.proc.poll() is None
    assert not any(path.exists() for path in workers)


def test_a_child_that_dies_of_the_stop_itself_is_read_as_the_stop(tmp_path: Path) -> None:
    """Ctrl-C reaches a loading child as well as the launcher: a death or a reported error
    seen with the stop already requested is the stop, not a failure to count or a failed
    start. Deterministic: the child has died before the fleet looks at it."""
    spawn = multiprocessing.get_context("spawn")

    def fleet(stop: threading.Event, target: Any) -> Fleet:
        role = Role(Supervision.engine(0), lambda _: ("engine_core_dp0", target, ()), 60.0)
        return Fleet(spawn, [role], [], tmp_path / "supervisor.json", stop)

    for target in (_dies_at_once, _reports_an_error):
        stopped = threading.Event()
        stopping = fleet(stopped, target)
        (role,) = stopping.engines
        stopping._start(role)
        assert role.child is not None
        role.child.proc.join(30)
        stopped.set()
        stopping._watch(role)  # neither raises nor counts it
        assert role.supervision.failures == [] and role.supervision.retry_at is None
        # Without a stop, the same death is counted, and the same error ends the start.
        counting = fleet(threading.Event(), target)
        (role,) = counting.engines
        counting._start(role)
        assert role.child is not None
        role.child.proc.join(30)
        if target is _dies_at_once:
            counting._watch(role)
            assert role.supervision.last_failure == "exited during start-up (exit code 3)"
        else:
            with pytest.raises(LaunchError, match="engine core 0 failed to start: no model"):
                counting._watch(role)


def _dies_at_once(ready: Connection) -> None:
    raise SystemExit(3)


def _reports_an_error(ready: Connection) -> None:
    ready.send(("error", "no model"))
