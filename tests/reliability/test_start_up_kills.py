"""A death during a fleet's start is recovered like one after it: each role killed at each
fragile moment of the start (before the model loads, during the KV commit, before any hello is
answered, during and after an API server's handshake) and the fleet serves again, every API
server answering /health 200 under the engine's next incarnation, within the bound a restart
after start-up has. While an API server is still starting, whoever answers /health says the
fleet is starting (503), never "ready".

Each trial is a fresh fleet: the tiny model, two API servers, and two ranks (TP=2, so that a
rank can die on its own) where the moment names a rank, with the moment's start-up holds armed
(`rankcast/start_up_holds.py`).
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.server_process import ServerProcess, tiny_model_args
from tests.frontend_rust.rust_fleet import frontend_env
from tests.reliability.start_up_kills import (
    Moment,
    arm,
    arm_hold,
    completion,
    kill_at,
    moments,
    release_all,
    wait_for_hold,
)

SERVERS = 2


def _fleet(
    model: Path, holds: Path, rust: int = 0, env: dict[str, str] | None = None, tp: int = 1
) -> ServerProcess:
    return ServerProcess(
        *tiny_model_args(model, "--tensor-parallel-size", str(tp)),
        api_server_count=SERVERS - rust,
        rust_api_server_count=rust,
        env={"RANKCAST_START_UP_HOLDS": str(holds), **(env or {})},
    )


# Every moment with the single rank inside the engine core's process (TP=1: the quickest fleet),
# and the moment a rank in a process of its own dies in (TP=2).
MOMENTS = (
    *moments(rank_processes=False),
    *(m for m in moments(rank_processes=True) if m.kill.startswith("worker")),
)


@pytest.mark.parametrize("moment", MOMENTS, ids=[m.what.replace(" ", "-") for m in MOMENTS])
def test_a_death_anywhere_in_the_start_is_recovered(
    tiny_llama_dir: Path, tmp_path: Path, moment: Moment
) -> None:
    arm(tmp_path, moment)
    launched = time.monotonic()
    # Ranks as processes of their own (TP=2) where the moment names one; elsewhere the
    # quicker single rank in the engine core's process (the moments are the same there).
    ranks = any(role.startswith("worker") for role in (moment.role, moment.kill))
    server = _fleet(tiny_llama_dir, tmp_path, tp=2 if ranks else 1)
    try:
        outcome = kill_at(server, tmp_path, moment, SERVERS, launched)
        print(f"\n{moment.name}: serving {outcome.serving_s:.1f} s after the kill")
    finally:
        release_all(tmp_path)
        assert server.stop() == []


def test_a_rust_api_server_says_hello_again_to_the_next_incarnation(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """The Rust API server's hello, taken by an engine core that died before answering it, is
    said again until the next incarnation answers (rust/client: `connect_speaking`)."""
    moment = Moment(
        "engine_core_dp0",
        "serve",
        "engine_core_dp0",
        "engine core holding the Rust API server's unanswered hello",
        also=("rust_api_server_1", "hello"),
    )
    arm(tmp_path, moment)
    launched = time.monotonic()
    server = _fleet(tiny_llama_dir, tmp_path, rust=1, env=frontend_env())
    try:
        kill_at(server, tmp_path, moment, SERVERS, launched)
    finally:
        release_all(tmp_path)
        assert server.stop() == []


@pytest.mark.parametrize("rust", [0, 1], ids=["python-answers", "rust-answers"])
def test_health_says_starting_until_every_api_server_is_ready(
    tiny_llama_dir: Path, tmp_path: Path, rust: int
) -> None:
    """While one API server is held mid-start, the other serves requests but answers /health
    503 with the fleet's progress; once both are up, both answer 200 and the body no longer
    carries `fleet`. The Python server answers while API server 1 is held; with a Rust server
    as API server 1, the Rust one answers while Python API server 0 is held."""
    held_role, answering = ("api_server_0", "1") if rust else ("api_server_1", "0")
    arm_hold(tmp_path, held_role, "handshaken")
    env = frontend_env() if rust else None
    server = _fleet(tiny_llama_dir, tmp_path, rust=rust, env=env)
    try:
        wait_for_hold(server, tmp_path, held_role, "handshaken")
        deadline = time.monotonic() + 60
        while True:  # until the launcher has seen the other server ready (it answers just before)
            assert time.monotonic() < deadline, f"API server {answering} never answered as ready"
            try:
                response = httpx.get(f"{server.url}/health", timeout=5)
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            assert response.status_code == 503, response.text
            assert response.headers["x-rankcast-api-server"] == answering
            assert response.headers["retry-after"]
            body = response.json()
            assert body["engines"][0]["up"] is True
            assert body["fleet"]["state"] == "starting" and body["fleet"]["api_servers"] == 2
            assert f"API server {1 - int(answering)}" in body["fleet"]["message"]
            if body["fleet"]["api_servers_ready"] == 1:
                break
            time.sleep(0.05)
        # It serves meanwhile: only its readiness for a load balancer waits for the fleet.
        assert completion(server.url)
        release_all(tmp_path)
        server.wait_healthy(60)
        for _ in range(20):
            response = httpx.get(f"{server.url}/health", timeout=5)
            assert response.status_code == 200 and "fleet" not in response.json()
    finally:
        release_all(tmp_path)
        assert server.stop() == []
