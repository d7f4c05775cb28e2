"""Kill a process at an exact moment of a fleet's start and time the fleet's return.

A moment is a start-up hold (`rankcast/start_up_holds.py`): the test arms `<role>@<point>`, the
process with that role waits there (the thread that reached it; its other threads go on), the
trial kills its target role (the held process itself or another one), lets the held process go
on if it still lives, and waits until every API server answers `/health` with 200 from the
engine's next incarnation when it died, and a completion is served. Used by the start-up
window tests (tests/reliability/test_start_up_kills.py) and, repeated, by
bench/start_up_kills.py.
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
from rankcast.start_up_holds import HELD_SUFFIX, held_file_name, hold_file_name
from tests.entrypoints.server_process import ServerProcess

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
    # A second hold that must be reached too before the kill: an API server's hello sent, so
    # that the engine core dies holding it unanswered, or an engine core still loading.
    also: tuple[str, str] | None = None

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
            "engine_core_dp0",
            "serve",
            "engine_core_dp0",
            "engine core holding API server 1's unanswered hello",
            also=("api_server_1", "hello"),
        ),
        Moment(
            "api_server_1",
            "hello",
            "engine_core_dp0",
            "engine core loading while API server 1's hello waits",
            also=("engine_core_dp0", "load"),
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


def wait_for_hold(
    server: ServerProcess, holds: Path, role: str, point: str, timeout_s: float = 120.0
) -> int:
    """The pid of `role` once it waits at its hold."""
    held = holds / held_file_name(role, point)
    deadline = time.monotonic() + timeout_s
    while not held.exists():
        assert time.monotonic() < deadline, f"{role} never reached its hold at {point}"
        assert server.proc.poll() is None, f"the launcher exited ({server.proc.returncode})"
        time.sleep(0.02)
    return server.pid_of(role)


def release_all(holds: Path) -> None:
    """Let every held thread go on (a trial that failed while one was held still stops
    cleanly)."""
    for held in holds.glob(f"*{HELD_SUFFIX}"):
        held.unlink(missing_ok=True)


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


def arm_hold(holds: Path, role: str, point: str) -> None:
    """Arm one hold in the directory `RANKCAST_START_UP_HOLDS` names."""
    holds.mkdir(parents=True, exist_ok=True)
    (holds / hold_file_name(role, point)).touch()


def arm(holds: Path, moment: Moment) -> None:
    """Arm `moment`'s holds."""
    arm_hold(holds, moment.role, moment.point)
    if moment.also is not None:
        arm_hold(holds, *moment.also)


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


def kill_at(
    server: ServerProcess, holds: Path, moment: Moment, servers: int, launched: float
) -> Outcome:
    """Run one trial on a fleet launched at `launched` with `moment` armed in `holds`: the
    fleet must serve again, under the engine's next incarnation when the engine core or a rank
    died."""
    held = wait_for_hold(server, holds, moment.role, moment.point)
    if moment.also is not None:
        wait_for_hold(server, holds, *moment.also)
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
    release_all(holds)
    engine_died = not moment.kill.startswith("api_server")
    until_serving(server.url, servers, 1 if engine_died else 0, SERVE_AGAIN_S)
    serving_s = time.monotonic() - killed
    assert completion(server.url)
    assert server.proc.poll() is None, "the launcher must keep running"
    assert not process_is_alive(victim)
    return Outcome(moment, held_s, serving_s, None if seen is None else seen[0])
