"""Stopping `rankcast serve`: new requests get 503 at once, requests in flight finish (or, past
`--shutdown-timeout`, end with a finish reason, an error event and [DONE]), and the launcher exits
0 leaving no process, IPC directory or shared memory behind. A stop during start-up is quick.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from rankcast.start_up_holds import held_file_name
from tests.entrypoints.server_process import (
    ServerProcess,
    assert_session_ends,
    free_port,
    launcher_while_loading,
    tiny_model_args,
    wait_until_healthy,
)
from tests.reliability.fleet import StreamedCompletion, assert_cut_by_the_shutdown
from tests.reliability.start_up_kills import arm_hold

MODEL = "SmolLM2-135M-Instruct"


def _leftovers() -> set[str]:
    """What a run can leave on the machine: IPC directories and shared-memory files."""
    tmp = {str(p) for p in Path(tempfile.gettempdir()).glob("rankcast-*")}
    return tmp | {str(p) for p in Path("/dev/shm").iterdir()}


def _stop_and_wait(server: ServerProcess, stream: StreamedCompletion, timeout_s: float) -> int:
    server.proc.send_signal(signal.SIGTERM)
    stream.thread.join(timeout_s)
    assert not stream.thread.is_alive(), "the stream must end, not hang"
    return server.proc.wait(timeout_s)


def test_stop_refuses_new_work_and_cuts_what_outlives_the_timeout() -> None:
    before = _leftovers()
    server = ServerProcess("--max-model-len", "1024", "--shutdown-timeout", "2")
    try:
        server.wait_healthy()
        # ~10 s here: longer than the timeout.
        stream = StreamedCompletion(server.url, model=MODEL, max_tokens=900)
        assert stream.first.wait(60), "the stream should be running before the stop"
        server.proc.send_signal(signal.SIGTERM)
        # At once: new requests and health checks get 503 with Retry-After, on every server.
        refused: dict[str, httpx.Response] = {}
        deadline = time.monotonic() + 1.5
        while len(refused) < 2 and time.monotonic() < deadline:
            with httpx.Client(timeout=10) as http:
                for path in ("/health", "/v1/models"):
                    try:
                        response = http.get(f"{server.url}{path}")
                    except httpx.TransportError:
                        # A server with nothing in flight closes its listener at once; a
                        # connection the kernel had queued on that listener is reset.
                        continue
                    if response.status_code == 503:
                        refused[f"{response.headers['x-rankcast-api-server']}{path}"] = response
        assert len(refused) >= 2, f"only {sorted(refused)} refused"
        for response in refused.values():
            assert response.headers["retry-after"]
            assert "shutting down" in response.json()["error"]["message"]
        stream.thread.join(30)
        assert not stream.thread.is_alive(), "the cut stream must end, not hang"
        assert server.proc.wait(30) == 0
    finally:
        assert server.stop() == []
    assert_cut_by_the_shutdown(stream)
    assert _leftovers() <= before, f"left behind: {_leftovers() - before}"


def test_requests_in_flight_finish_when_they_can() -> None:
    server = ServerProcess("--max-model-len", "1024", "--shutdown-timeout", "30")
    try:
        server.wait_healthy()
        stream = StreamedCompletion(server.url, model=MODEL, max_tokens=48)
        assert stream.first.wait(60)
        assert _stop_and_wait(server, stream, 60) == 0
    finally:
        assert server.stop() == []
    chunks = list(stream.chunks())
    assert not [c for c in chunks if "error" in c]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
    assert stream.events[-1] == "[DONE]"


def test_ctrl_c_during_start_up_is_a_stop_not_a_failure() -> None:
    """Ctrl-C reaches the whole process group, so the loading engine core dies of it too: the
    launcher must read that as the stop it is (exit 0), not as a child that failed (exit 1)."""
    with launcher_while_loading() as (launcher, _):
        os.killpg(launcher.pid, signal.SIGINT)
        _, stderr = launcher.communicate(timeout=30)
    assert launcher.returncode == 0, stderr
    assert "exited during start-up" not in stderr
    assert_session_ends(launcher.pid)


def test_a_stop_during_start_up_ends_it_at_once(tmp_path: Path) -> None:
    """SIGTERM while the engine core loads ends the start-up there, without waiting for the
    load: the load is held (a start-up hold at the engine core's `load` point) until the test
    lets it go, which it never does, so a launcher that waited for it would not end at all."""
    holds = tmp_path / "holds"
    role, point = "engine_core_dp0", "load"
    arm_hold(holds, role, point)
    held = holds / held_file_name(role, point)
    with launcher_while_loading(env={"RANKCAST_START_UP_HOLDS": str(holds)}) as (launcher, _):
        deadline = time.monotonic() + 60
        while not held.exists():
            assert launcher.poll() is None, f"the launcher exited ({launcher.returncode})"
            assert time.monotonic() < deadline, "the engine core never reached its load"
            time.sleep(0.02)
        launcher.send_signal(signal.SIGTERM)
        launcher.communicate(timeout=30)
        assert held.exists(), "the load went on before the launcher stopped"
    assert launcher.returncode == 0
    assert_session_ends(launcher.pid)  # ranks still loading go when their C call returns


@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C"])
def test_a_served_fleet_stops_cleanly_on_a_signal(tiny_llama_dir: Path, how: str) -> None:
    """After serving, SIGTERM to the launcher (or Ctrl-C: SIGINT to the whole group) ends every
    process with exit 0 and no traceback from any of them: the signal wakes the launcher's and
    the engine core's waits (their wakeup sockets), and nothing in that path may fail."""
    port = free_port()
    launcher = subprocess.Popen(
        [sys.executable, "-m", "rankcast.launcher.cli", "serve", "--port", str(port),
         *tiny_model_args(tiny_llama_dir), "--api-server-count", "2"],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "RANKCAST_DISABLE_PROGRESS": "1"},
    )  # fmt: skip
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", timeout_s=120)
        answer = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"prompt": [5, 17, 300], "max_tokens": 2, "ignore_eos": True},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        if how == "SIGTERM":
            launcher.send_signal(signal.SIGTERM)
        else:
            os.killpg(launcher.pid, signal.SIGINT)
        _, stderr = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.communicate(timeout=10)
    assert launcher.returncode == 0, stderr
    assert "Traceback" not in stderr, stderr
    assert_session_ends(launcher.pid)
