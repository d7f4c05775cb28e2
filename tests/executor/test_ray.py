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
from rankcast.executor.base import ExecutorError
from tests.entrypoints.server_process import free_port
from tests.executor.helpers import fail_on_rank, own_pid

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


@pytest.fixture(scope="module")
def ray_tp2(ray_cluster: str, tiny_llama_dir: Path) -> Iterator[LLM]:
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        kv_cache_space_gib=0.05,
    )
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


def test_ray_dead_actor_fails_the_engine(ray_tp2: LLM) -> None:
    executor = ray_tp2.engine.client.core.executor
    pid = executor.collective_rpc(own_pid)[1]
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(ExecutorError, match=r"rank 1 \(Ray actor"):
        ray_tp2.generate(["hello"], SamplingParams(max_tokens=20, ignore_eos=True))
    assert time.monotonic() - start < 30
