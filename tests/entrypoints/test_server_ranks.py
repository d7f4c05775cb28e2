"""Serving with several ranks: a dead worker rank makes every API server answer 503; the engine
core, whose ranks are processes of their own, never loads torch (its ranks import it while it
goes on starting: a TP=2 start ~1 s shorter)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx

from tests.entrypoints.server_process import ServerProcess, process_title


def test_a_dead_rank_makes_every_api_server_answer_503(tiny_llama_dir: Path) -> None:
    proc = ServerProcess(
        str(tiny_llama_dir),
        "--tensor-parallel-size",
        "2",
        "--dtype",
        "float32",
        "--kv-cache-space",
        "0.05",
    )
    try:
        proc.wait_healthy()
        completion = httpx.post(
            f"{proc.url}/v1/completions",
            json={"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
        assert completion.status_code == 200, completion.text
        titles = {"rankcast::worker_dp0_pp0_tp0", "rankcast::worker_dp0_pp0_tp1"}
        assert titles <= {process_title(pid) for pid in proc.pids}, "each rank names itself"
        mapped = Path(f"/proc/{proc.pid_of('engine_core_dp0')}/maps").read_text()
        assert "libtorch" not in mapped, "the engine core imported torch, which its ranks run"
        assert "libtorch" in Path(f"/proc/{proc.pid_of('worker_dp0_pp0_tp1')}/maps").read_text()
        os.kill(proc.pid_of("worker_dp0_pp0_tp1"), signal.SIGKILL)
        unhealthy: set[str] = set()
        deadline = time.monotonic() + 10
        while len(unhealthy) < 2 and time.monotonic() < deadline:
            with httpx.Client(timeout=5) as http:
                response = http.get(f"{proc.url}/health")
            if response.status_code == 503:
                unhealthy.add(response.headers["x-rankcast-api-server"])
        assert unhealthy == {"0", "1"}, "an idle engine must still fail promptly on a dead rank"
    finally:
        leftovers = proc.stop()
    assert leftovers == []
