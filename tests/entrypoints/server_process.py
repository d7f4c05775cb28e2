"""Run a real `rankcast serve` for tests, and always leave no process behind."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from rankcast.process import process_is_alive, process_table


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# The state column of /proc/net/tcp.
TCP_ESTABLISHED = "01"
TCP_LISTEN = "0A"
TCP_TIME_WAIT = "06"


def sockets_on_port(port: int, state: str) -> int:
    """This machine's TCP sockets whose local end is `port`, in `state` (TCP_LISTEN, ...)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port and fields[3] == state:
                count += 1
    return count


def wait_until_healthy(
    url: str, process: subprocess.Popen[Any] | None = None, timeout_s: float = 120.0
) -> None:
    """Wait for one server's `/health` to answer 200; a `process` (the server) that exits
    meanwhile fails at once, with what it wrote to stderr when that was piped."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            stderr = process.communicate()[1] if process.stderr else ""
            raise AssertionError(f"{url}: the server exited with {process.returncode}: {stderr}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not become healthy in {timeout_s:.0f} s")


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, found through /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] in ("Z", "X"):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def process_title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


class ServerProcess:
    """`rankcast serve` in its own session; `stop()` checks that shutdown left nothing behind."""

    def __init__(
        self,
        *args: str,
        api_server_count: int = 2,
        rust_api_server_count: int = 0,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        port: int | None = None,
    ) -> None:
        """`cwd`: run the rankcast found there (`python -m` looks in its directory first): a
        benchmark's way to serve an older checkout side by side. `wait_healthy` waits for
        every server, Python and Rust."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server_count = api_server_count + rust_api_server_count
        if rust_api_server_count:
            args = (*args, "--rust-api-server-count", str(rust_api_server_count))
        env = dict(os.environ, RANKCAST_DISABLE_PROGRESS="1", **(env or {}))
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rankcast.launcher.cli",
                "serve",
                "--port",
                str(self.port),
                "--api-server-count",
                str(api_server_count),
                *args,
            ],
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
        self.pids: list[int] = []

    def wait_healthy(self, timeout_s: float = 240.0) -> None:
        """Wait until every API server answers /health (new connections reach either)."""
        deadline = time.monotonic() + timeout_s
        healthy: set[str] = set()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rankcast serve exited with {self.proc.returncode}")
            try:
                with httpx.Client(timeout=2) as http:
                    response = http.get(f"{self.url}/health")
                if response.status_code == 200:
                    healthy.add(response.headers["x-rankcast-api-server"])
                if len(healthy) == self.server_count:
                    self.pids = descendants(self.proc.pid)
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            # Polled, not spun: a tight loop of 503s took CPU from the start it waits on.
            time.sleep(0.05)
        raise TimeoutError(f"only API servers {sorted(healthy)} became healthy")

    def pid_of(self, role: str) -> int:
        for pid in descendants(self.proc.pid):
            if process_title(pid) == f"rankcast::{role}":
                return pid
        raise LookupError(role)

    @contextlib.contextmanager
    def running(self) -> Iterator[ServerProcess]:
        """Wait until every API server is healthy and hand the server over; afterwards stop
        it and fail if that left any of its processes behind."""
        try:
            self.wait_healthy()
            yield self
        finally:
            leftovers = self.stop()
        assert leftovers == [], f"shutdown left processes behind: {leftovers}"

    def kill_and_await_restart(self, role: str, timeout_s: float = 120.0) -> None:
        """SIGKILL one API server (`api_server_N`), wait for the launcher to start a new one,
        then for every server to answer /health."""
        old = self.pid_of(role)
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + timeout_s
        while True:
            assert time.monotonic() < deadline, f"{role} was not restarted"
            with contextlib.suppress(LookupError):
                if self.pid_of(role) != old:
                    break
            time.sleep(0.2)
        self.wait_healthy()

    def stop(self, timeout_s: float = 30.0) -> list[int]:
        """SIGTERM the launcher; return those of its processes still alive afterwards."""
        tracked = set(self.pids)
        if self.proc.poll() is None:
            tracked |= set(descendants(self.proc.pid))
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)
        deadline = time.monotonic() + 10
        alive = [p for p in tracked if process_is_alive(p)]
        while alive and time.monotonic() < deadline:
            time.sleep(0.2)
            alive = [p for p in alive if process_is_alive(p)]
        self.kill()
        return alive

    def kill(self) -> None:
        """Last resort, for failures: kill the whole session."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)


def tiny_model_args(model_dir: Path, *extra: str) -> tuple[str, ...]:
    """`rankcast serve` arguments for the tiny random-weight model, float32, a small cache."""
    return (str(model_dir), "--dtype", "float32", "--kv-cache-space", "0.05", *extra)


def in_session(session: int) -> dict[int, str]:
    """Every process of a session, zombies included, with its state (R, S, Z, ...)."""
    return {p.pid: p.state for p in process_table() if p.session == session}


def alive_in_session(session: int) -> list[int]:
    """Live processes of a session (orphans included, wherever they were moved)."""
    return [pid for pid, state in in_session(session).items() if state not in ("Z", "X")]


def assert_session_ends(session: int, timeout_s: float = 10.0) -> None:
    """Wait until no process of `session` is alive, failing after `timeout_s`: for launchers
    that did not exit on their own (killed, or failed before they could reap). A launcher that
    exits leaves nothing at all (tests/reliability/test_nothing_left_behind.py)."""
    deadline = time.monotonic() + timeout_s
    while alive := alive_in_session(session):
        assert time.monotonic() < deadline, f"processes left behind: {alive}"
        time.sleep(0.05)


def next_engine_core(launcher: subprocess.Popen[Any], old: int | None, timeout_s: float) -> int:
    """The pid of the launcher's engine core as soon as one other than `old` exists."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert time.monotonic() < deadline, "no engine core appeared"
        assert launcher.poll() is None, "the launcher exited before an engine core started"
        for pid in descendants(launcher.pid):
            if pid != old and process_title(pid) == "rankcast::engine_core_dp0":
                return pid
        time.sleep(0.02)


@contextlib.contextmanager
def launcher_while_loading(
    timeout_s: float = 60.0, env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """`rankcast serve` of the embedded model (seconds to load), handed over as soon as its
    engine core exists, with that process's pid; stderr is piped; `env` added to the
    environment. The whole session is killed afterwards if the launcher is still running."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "rankcast.launcher.cli", "serve", "--port", str(free_port())],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "RANKCAST_DISABLE_PROGRESS": "1", **(env or {})},
    )
    try:
        yield launcher, next_engine_core(launcher, None, timeout_s)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.communicate(timeout=10)
