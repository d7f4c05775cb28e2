"""Data parallel serving: two engine cores behind two API servers, balanced by broadcast load."""

from __future__ import annotations

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from rankcast.engine_client.load_balancer import LoadBalancer
from rankcast.protocol import SchedulerStats
from tests.entrypoints.server_process import ServerProcess, process_title, tiny_model_args


def test_balancer_prefers_the_least_loaded_engine_and_rotates_ties() -> None:
    balancer = LoadBalancer(3)
    first_three = [balancer.choose([True] * 3) for _ in range(3)]
    assert sorted(first_three) == [0, 1, 2], "equal engines share a burst"
    balancer.record_stats(0, SchedulerStats(num_waiting_reqs=0, num_running_reqs=5))
    balancer.record_stats(1, SchedulerStats(num_waiting_reqs=2, num_running_reqs=0))
    balancer.record_stats(2, SchedulerStats(num_waiting_reqs=0, num_running_reqs=1))
    assert balancer.choose([True] * 3) == 2
    # Its own sends count until the next report, so a burst spreads out.
    assert balancer.choose([True] * 3) == 0
    assert balancer.choose([True, True, False]) == 0, "dead engines are skipped"
    assert balancer.choose([False, True, False]) == 1


def _scrape_both(url: str) -> dict[str, str]:
    samples: dict[str, str] = {}
    deadline = time.monotonic() + 30
    while len(samples) < 2 and time.monotonic() < deadline:
        with httpx.Client(timeout=10) as http:
            response = http.get(f"{url}/metrics")
        samples[response.headers["x-rankcast-api-server"]] = response.text
    return samples


def _two_engines(tiny_llama_dir: Path) -> ServerProcess:
    return ServerProcess(*tiny_model_args(tiny_llama_dir, "--data-parallel-size", "2"))


def test_two_engine_cores_share_the_work(tiny_llama_dir: Path) -> None:
    proc = _two_engines(tiny_llama_dir)
    try:
        proc.wait_healthy()
        titles = {process_title(pid) for pid in proc.pids}
        assert {"rankcast::engine_core_dp0", "rankcast::engine_core_dp1"} <= titles

        def complete(seed: int) -> int:
            with httpx.Client(timeout=120) as http:
                response = http.post(
                    f"{proc.url}/v1/completions",
                    json={
                        "prompt": [5, 6, seed],
                        "max_tokens": 40,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                )
            assert response.status_code == 200, response.text
            return response.json()["usage"]["completion_tokens"]

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(complete, range(16))) == [40] * 16
        samples = _scrape_both(proc.url)
        assert set(samples) == {"0", "1"}
        # Every API server reports the fleet's totals (tests/entrypoints/test_server_fleet_...).
        views = [
            {
                engine: float(value)
                for engine, value in re.findall(
                    r'vllm:request_success_total\{engine="(\d)",.*\} (\S+)', text
                )
            }
            for text in samples.values()
        ]
        finished = views[0]
        assert views[1] == finished
        assert finished["0"] > 0 and finished["1"] > 0, f"both engines get work: {finished}"
        assert sum(finished.values()) == 16
        for text in samples.values():
            for engine in ("0", "1"):
                assert f'vllm:num_requests_running{{engine="{engine}"' in text
    finally:
        leftovers = proc.stop()
    assert leftovers == []


def _finished_by_engine(url: str) -> dict[str, float]:
    text = next(iter(_scrape_both(url).values()))
    return {
        engine: float(value)
        for engine, value in re.findall(
            r'vllm:request_success_total\{engine="(\d)",.*\} (\S+)', text
        )
    }


def _all_served(url: str, body: dict[str, object], count: int, workers: int) -> None:
    """`count` completions, `workers` at a time: every one answered 200 (no 503)."""
    with ThreadPoolExecutor(workers) as pool:
        statuses = list(
            pool.map(
                lambda _: httpx.post(f"{url}/v1/completions", json=body, timeout=60),
                range(count),
            )
        )
    assert [r.status_code for r in statuses] == [200] * count, [r.text for r in statuses]


def test_a_dead_engine_is_routed_around_and_named_by_health(tiny_llama_dir: Path) -> None:
    proc = _two_engines(tiny_llama_dir)
    body = {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    try:
        proc.wait_healthy()
        os.kill(proc.pid_of("engine_core_dp1"), signal.SIGKILL)
        # Both API servers notice (each has its own connection), and stay healthy: one engine
        # still serves, and the body says which is gone.
        noticed: set[str] = set()
        deadline = time.monotonic() + 10
        while len(noticed) < 2:
            assert time.monotonic() < deadline, f"only API servers {sorted(noticed)} noticed"
            with httpx.Client(timeout=10) as http:
                health = http.get(f"{proc.url}/health")
            assert health.status_code == 200, health.text
            engines = health.json()["engines"]
            if [e["up"] for e in engines] == [True, False]:
                assert "exited" in engines[1]["error"] or "closed" in engines[1]["error"]
                noticed.add(health.headers["x-rankcast-api-server"])
        _all_served(proc.url, body, 12, workers=4)
        # The launcher starts the dead engine again; both servers reconnect, and it rejoins the
        # balance: new requests reach it.
        back: set[str] = set()
        deadline = time.monotonic() + 60
        while len(back) < 2:
            assert time.monotonic() < deadline, f"only API servers {sorted(back)} see it back"
            with httpx.Client(timeout=10) as http:
                health = http.get(f"{proc.url}/health")
            if [e["up"] for e in health.json()["engines"]] == [True, True]:
                back.add(health.headers["x-rankcast-api-server"])
            time.sleep(0.1)
        before = _finished_by_engine(proc.url).get("1", 0.0)
        _all_served(proc.url, body, 16, workers=8)
        assert _finished_by_engine(proc.url)["1"] > before, "the restarted engine gets work"
    finally:
        leftovers = proc.stop()
    assert leftovers == []
