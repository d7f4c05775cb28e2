"""What an operator sees when starting `rankcast serve` goes wrong, or when it is started again.

A child killed during start-up is one clear line naming its role and exit status, and the launcher
exits non-zero; a restart on the same port right after a stop works although the last run's
connections are still in TIME_WAIT.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from rankcast.entrypoints.launcher import LaunchError, StoppedDuringStartUp, _wait_ready
from tests.entrypoints.server_process import (
    ServerProcess,
    assert_session_ends,
    free_port,
    launcher_while_loading,
    tiny_model_args,
)

TIME_WAIT = "06"  # the state column of /proc/net/tcp


def _time_wait_sockets(port: int) -> int:
    """Sockets whose local end is `port` and that are in TIME_WAIT."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port and fields[3] == TIME_WAIT:
                count += 1
    return count


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
    assert _time_wait_sockets(port) > 0, "the test needs TIME_WAIT sockets on the port"
    second = ServerProcess(*args, api_server_count=1, port=port)
    with second.running():
        assert httpx.get(f"{second.url}/health", timeout=30).status_code == 200


def test_a_child_killed_during_start_up_is_one_clear_line_and_a_failed_exit() -> None:
    with launcher_while_loading() as (launcher, engine):
        os.kill(engine, signal.SIGKILL)
        _, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode != 0
    assert "Traceback" not in stderr and "EOFError" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("rankcast: error:")]
    assert errors == ["rankcast: error: engine core dp0 exited during start-up (exit code -9)"]
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


def test_a_child_that_dies_of_the_stop_itself_is_read_as_the_stop() -> None:
    """Ctrl-C reaches a loading child as well as the launcher: when its death (EOF on its
    readiness pipe) is seen with the stop already requested, that is the stop (exit 0), not a
    failed start (exit 1). Deterministic: the pipe is closed before the wait begins."""
    spawn = multiprocessing.get_context("spawn")
    child = spawn.Process(target=int)
    child.start()
    child.join(30)
    read, write = spawn.Pipe(duplex=False)
    write.close()
    stop = threading.Event()
    stop.set()
    with pytest.raises(StoppedDuringStartUp):
        _wait_ready("engine core", child, read, 5.0, stop)
    # Without a stop, the same death is a failed start naming the role and exit status.
    with pytest.raises(LaunchError, match="engine core exited during start-up") as failed:
        _wait_ready("engine core", child, read, 5.0, threading.Event())
    assert not isinstance(failed.value, StoppedDuringStartUp)
