"""Kill a process at an exact moment of a fleet's start and time the fleet's return.

A moment is a start-up hold (`rankcast/start_up_holds.py`): the test arms `<role>@<point>`, the
process with that role stops itself there, the trial kills its target role (the held process
itself or another one), resumes the held process if it still lives, and waits until every API
server answers `/health` with 200 and a completion is served. Used by the start-up window tests
(tests/reliability/test_start_up_kills.py) and, repeated, by bench/start_up_kills.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from rankcast.process import process_is_alive
from rankcast.start_up_holds import hold_file_name
from tests.entrypoints.server_process import ServerProcess, descendants

# Past this, a fleet counts as hung (the bound the supervised-restart tests use for a kill
# after start-up is 20 s; a start-up kill adds at most the rest of the start).
SERVE_AGAIN_S = 30.0


@dataclass(frozen=True)
class Moment:
    """Where the start is held (`role` stops at `point`) and which role is killed then."""

    role: str
    point: str
    kill: str
    what: str  # in words, for a test id and a table row

    @property
    def name(self) -> str:
        return f"{self.kill} killed while {self.role} holds at {self.point}"


def moments(rank_processes: bool = True) -> tuple[Moment, ...]:
    """Every role at the points of its start where a death used to strand the fleet, or
    could. `rank_processes`: ranks are processes of their own (TP > 1), so a rank can die
    alone; otherwise the KV commit runs in the engine core's process."""
    commit = "worker_dp0_pp0_tp0" if rank_processes else "engine_core_dp0"
    ranks = (
        (
            Moment(
                "worker_dp0_pp0_tp1",
                "kv_commit",
                "worker_dp0_pp0_tp1",
                "a rank during its KV commit",
            ),
        )
        if rank_processes
        else ()
    )
    return (
        Moment("engine_core_dp0", "load", "engine_core_dp0", "engine core before its model loads"),
        *ranks,
        Moment(commit, "kv_commit", "engine_core_dp0", "engine core during the KV commit"),
        Moment(
            "engine_core_dp0", "serve", "engine_core_dp0", "engine core before any hello answered"
        ),
        Moment(
            "api_server_1", "hello", "engine_core_dp0", "engine core during API server 1's hello"
        ),
        Moment("api_server_1", "hello", "api_server_1", "API server 1 during its hello"),
        Moment(
            "api_server_1",
            "handshaken",
            "engine_core_dp0",
            "engine core after API server 1's handshake",
        ),
        Moment("api_server_1", "handshaken", "api_server_1", "API server 1 after its handshake"),
    )


@dataclass(frozen=True)
class Outcome:
    moment: Moment
    held_s: float  # from the launch until the hold was reached
    serving_s: float  # from the kill until every API server answered 200
    health_while_held: int | None  # what /health answered while held (None: no server up)


def held_state(pid: int) -> bool:
    """Whether `pid` is stopped (SIGSTOP): the hold was reached."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def wait_for_hold(server: ServerProcess, role: str, timeout_s: float = 120.0) -> int:
    """The pid of `role` once it has stopped at its hold."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert time.monotonic() < deadline, f"{role} never reached its hold"
        assert server.proc.poll() is None, f"the launcher exited ({server.proc.returncode})"
        with contextlib.suppress(LookupError):
            pid = server.pid_of(role)
            if held_state(pid):
                return pid
        time.sleep(0.02)


def resume_all(server: ServerProcess) -> None:
    """SIGCONT every process of the fleet, so that a trial that failed while one was held
    still stops cleanly (a stopped process cannot act on the launcher's SIGTERM)."""
    for pid in descendants(server.proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def health_now(url: str) -> tuple[int, dict[str, object]] | None:
    """What /health answers now (status, body), or None when nothing listens yet."""
    try:
        response = httpx.get(f"{url}/health", timeout=5)
    except httpx.HTTPError:
        return None
    return response.status_code, response.json()


def completion(url: str) -> str:
    response = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": "Hello", "max_tokens": 4, "temperature": 0},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def arm(holds: Path, moment: Moment) -> None:
    holds.mkdir(parents=True, exist_ok=True)
    (holds / hold_file_name(moment.role, moment.point)).touch()


def until_serving(url: str, servers: int, incarnation: int, timeout_s: float) -> None:
    """Wait until each of `servers` API servers has answered /health with 200 from engine
    incarnation `incarnation` (a kill must have been followed by a restart, not merely be
    unnoticed yet); fails past `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    seen: set[str] = set()
    last: object = None
    while len(seen) < servers:
        assert time.monotonic() < deadline, f"hung: only API servers {sorted(seen)}; last {last}"
        with contextlib.suppress(httpx.HTTPError):
            response = httpx.get(f"{url}/health", timeout=5)
            last = (response.status_code, response.text)
            engines = response.json()["engines"]
            if response.status_code == 200 and engines[0]["incarnation"] == incarnation:
                seen.add(response.headers["x-rankcast-api-server"])
        time.sleep(0.05)


def kill_at(server: ServerProcess, moment: Moment, servers: int, launched: float) -> Outcome:
    """Run one trial on a fleet launched at `launched` with `moment` armed: the fleet must
    serve again, under the engine's next incarnation when the engine core or a rank died."""
    held = wait_for_hold(server, moment.role)
    held_s = time.monotonic() - launched
    seen = health_now(server.url)
    if moment.role.startswith("api_server") and seen is not None:
        # A fleet with an API server held mid-start has not started: whoever answers says so.
        status, body = seen
        assert status == 503, (status, body)
        fleet = body.get("fleet")
        assert isinstance(fleet, dict) and fleet["state"] == "starting", body
    victim = held if moment.kill == moment.role else server.pid_of(moment.kill)
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    if victim != held and process_is_alive(held):
        os.kill(held, signal.SIGCONT)
    engine_died = not moment.kill.startswith("api_server")
    until_serving(server.url, servers, 1 if engine_died else 0, SERVE_AGAIN_S)
    serving_s = time.monotonic() - killed
    assert completion(server.url)
    assert server.proc.poll() is None, "the launcher must keep running"
    assert not process_is_alive(victim)
    return Outcome(moment, held_s, serving_s, None if seen is None else seen[0])
