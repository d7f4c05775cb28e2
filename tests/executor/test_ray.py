"""The Ray executor against a local Ray instance the test starts: equality and failures."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rankcast import LLM, SamplingParams
from rankcast.channel.events import WEIGHTS_LOADED_KEY, CustomNotification
from rankcast.executor.base import ExecutorError
from tests.entrypoints.notification_clients import (
    open_event_streams,
    producer_server_args,
    scrape_each,
    series,
    worker_rpc,
)
from tests.entrypoints.server_process import ServerProcess, free_port
from tests.executor.helpers import (
    fail_on_rank,
    own_pid,
    publish_later_on_rank,
    publish_on_rank,
)
from tests.worker.producers import KEY

ray = pytest.importorskip("ray")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    ray_bin = str(Path(sys.executable).with_name("ray"))
    port = free_port()
    # A private HOME: a ~/.ray/auth_token left by another Ray session would switch the head to
    # token authentication, which this test's client does not use.
    home = tmp_path_factory.mktemp("ray-home")
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", HOME=str(home))
    subprocess.run(
        [
            ray_bin,
            "start",
            "--head",
            f"--port={port}",
            "--num-cpus=2",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ],
        check=True,
        env=env,
        capture_output=True,
        timeout=180,
    )
    address = f"127.0.0.1:{port}"
    previous = os.environ.get("RANKCAST_RAY_ADDRESS")
    os.environ["RANKCAST_RAY_ADDRESS"] = address
    try:
        yield address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if previous is None:
            os.environ.pop("RANKCAST_RAY_ADDRESS", None)
        subprocess.run([ray_bin, "stop", "--force"], env=env, capture_output=True, timeout=120)


def _ray_tp2_llm(model_dir: Path) -> LLM:
    return LLM(
        str(model_dir),
        dtype="float32",
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        kv_cache_space_gib=0.05,
    )


@pytest.fixture(scope="module")
def ray_tp2(ray_cluster: str, tiny_llama_dir: Path) -> Iterator[LLM]:
    """Shared by the tests that leave both ranks alive (they run in any order)."""
    llm = _ray_tp2_llm(tiny_llama_dir)
    yield llm
    llm.shutdown()


def test_ray_tp2_matches_one_rank(tiny_llama_dir: Path, ray_tp2: LLM) -> None:
    with LLM(str(tiny_llama_dir), dtype="float32", kv_cache_space_gib=0.05) as single:
        want = [o.outputs[0].token_ids for o in single.generate(PROMPTS, GREEDY)]
    assert [o.outputs[0].token_ids for o in ray_tp2.generate(PROMPTS, GREEDY)] == want
    executor = ray_tp2.engine.client.core.executor
    assert executor.collective_rpc("rank_info") == [(0, 0, 0), (1, 0, 1)]


def test_ray_rank_failure_is_named(ray_tp2: LLM) -> None:
    executor = ray_tp2.engine.client.core.executor
    with pytest.raises(ExecutorError, match="rank 1 failed") as info:
        executor.collective_rpc(fail_on_rank, (1,))
    assert "injected failure on rank 1" in str(info.value) and "Traceback" in str(info.value)
    assert executor.collective_rpc("rank_info") == [(0, 0, 0), (1, 0, 1)]


def _ray_events(llm: LLM, count: int, timeout_s: float = 30) -> list[CustomNotification]:
    got: list[CustomNotification] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count:
        assert time.monotonic() < deadline, f"{len(got)} of {count} events arrived"
        got += [
            n
            for n in llm.take_notifications()
            if isinstance(n, CustomNotification) and n.key == "test.ray"
        ]
        time.sleep(0.05)
    return got


def test_ray_ranks_deliver_events_without_shared_memory(ray_tp2: LLM) -> None:
    loads = [
        n
        for n in ray_tp2.take_notifications()
        if isinstance(n, CustomNotification) and n.key == WEIGHTS_LOADED_KEY
    ]
    assert [(n.rank, n.tp_rank) for n in loads] == [(0, 0), (1, 1)]
    executor = ray_tp2.engine.client.core.executor
    # The reply of the call that published carries the doorbell flag.
    executor.collective_rpc(publish_on_rank, (1, 2))
    assert executor.remote_doorbell
    assert [(n.rank, n.payload["i"]) for n in _ray_events(ray_tp2, 2)] == [(1, 0), (1, 1)]
    # Published after every call returned, while idle: the liveness ping carries the flag.
    executor.collective_rpc(publish_later_on_rank, (0, 0.2))
    (later,) = _ray_events(ray_tp2, 1)
    assert later.rank == 0 and later.payload == {"later": True}
    assert ray_tp2.config.notifications.poll_interval is None


def test_ray_dead_actor_fails_the_engine(ray_cluster: str, tiny_llama_dir: Path) -> None:
    """Kills a rank, so it has an engine of its own."""
    with _ray_tp2_llm(tiny_llama_dir) as llm:
        executor = llm.engine.client.core.executor
        pid = executor.collective_rpc(own_pid)[1]
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(ExecutorError, match=r"rank 1 \(Ray actor"):
            llm.generate(["hello"], SamplingParams(max_tokens=20, ignore_eos=True))
        assert time.monotonic() - start < 30


def test_ray_ranks_reach_every_api_server(ray_cluster: str, tiny_llama_dir: Path) -> None:
    server = ServerProcess(
        *producer_server_args(
            tiny_llama_dir, "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"
        ),
        api_server_count=3,
    )
    try:
        server.wait_healthy(timeout_s=300)
        readers = open_event_streams(server.url, 3, params={"key": KEY})
        try:
            assert worker_rpc(server.url, "publish_events", 2).json() == {"results": [[0, 1]]}
            streams = [reader.wait_for(4) for reader in readers.values()]
        finally:
            for reader in readers.values():
                reader.close()
        assert [(d["rank"], d["payload"]["i"]) for _, d in streams[0]] == [
            (0, 0),
            (0, 1),
            (1, 0),
            (1, 1),
        ]
        assert all(stream == streams[0] for stream in streams)
        loads = {
            i: series(text, "rankcast:worker_weights_load_bytes{")
            for i, text in scrape_each(server.url, 3).items()
        }
        assert len(loads["0"]) == 2 and all(view == loads["0"] for view in loads.values())
    finally:
        assert server.stop() == []
