"""An engine core that keeps dying is given up on: after three failures within five minutes the
launcher stops restarting it, the API servers stay up answering 503, and /health says why. A
module of its own: it leaves its server's engine dead."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import httpx

from rankcast.process import process_is_alive
from tests.entrypoints.server_process import ServerProcess, tiny_model_args


def _next_engine(server: ServerProcess, old: int, timeout_s: float = 60) -> int:
    """The pid of the engine core the launcher starts after `old`."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert time.monotonic() < deadline, "the engine core was not started again"
        with contextlib.suppress(LookupError):
            pid = server.pid_of("engine_core_dp0")
            if pid != old:
                return pid
        time.sleep(0.1)


def test_three_failures_in_five_minutes_and_the_launcher_gives_up(tiny_llama_dir: Path) -> None:
    server = ServerProcess(*tiny_model_args(tiny_llama_dir), api_server_count=1)
    with server.running():
        engine = server.pid_of("engine_core_dp0")
        for _ in range(2):  # two deaths: each is followed by a new incarnation
            os.kill(engine, signal.SIGKILL)
            engine = _next_engine(server, engine)
            server.wait_healthy(60)
        os.kill(engine, signal.SIGKILL)  # the third
        deadline = time.monotonic() + 30
        while True:
            assert time.monotonic() < deadline, "/health never reported the give-up"
            with httpx.Client(timeout=5) as http:
                health = http.get(f"{server.url}/health")
            (entry,) = health.json()["engines"]
            if entry.get("supervisor", {}).get("state") == "given_up":
                assert health.status_code == 503
                break
            time.sleep(0.1)
        assert "failed 3 times within 300 s" in entry["supervisor"]["message"]
        assert not process_is_alive(engine)
        # Given up means given up: watched for longer than any back-off (a restart would have
        # begun), no fourth incarnation appears and the server stays up, saying so.
        watch_until = time.monotonic() + 5
        while time.monotonic() < watch_until:
            with contextlib.suppress(LookupError):
                assert server.pid_of("engine_core_dp0") == engine, "a fourth incarnation"
            with httpx.Client(timeout=5) as http:
                health = http.get(f"{server.url}/health")
            assert health.status_code == 503
            assert health.json()["engines"][0]["supervisor"]["state"] == "given_up"
            time.sleep(0.2)
