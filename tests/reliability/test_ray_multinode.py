"""Ranks on two Ray nodes: a 2-node cluster on this machine (two raylets, one CPU each), the
embedded SmolLM2 served with PP=2 and `--ray-placement strict-spread`, so each pipeline stage
sits on a node of its own. Greedy text equals one rank's in float32; the remote node's events
reach every API server (Ray carries them: there is no shared memory between nodes); removing
that node makes every API server answer 503 within 5 s, and once a node is back the launcher's
restarted engine serves again."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from rankcast import LLM, SamplingParams
from tests.entrypoints.notification_clients import PRODUCER, open_event_streams, worker_rpc
from tests.entrypoints.server_process import ServerProcess
from tests.reliability.fleet import until_every_server

ray = pytest.importorskip("ray")
SERVERS = 2
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from ray.cluster_utils import Cluster

    # A private HOME: a ~/.ray/auth_token left by another Ray session would switch the head to
    # token authentication (see test_ray.py).
    saved = {k: os.environ.get(k) for k in ("HOME", "RAY_USAGE_STATS_ENABLED")}
    os.environ["HOME"] = str(tmp_path_factory.mktemp("ray-home"))
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _greedy(url: str) -> str:
    with httpx.Client(timeout=120) as http:
        response = http.post(
            f"{url}/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
        )
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def test_pipeline_stages_on_two_nodes(cluster: Any, smollm_fp32: LLM) -> None:
    (want,) = smollm_fp32.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    )
    server = ServerProcess(
        "--pipeline-parallel-size",
        "2",
        "--distributed-executor-backend",
        "ray",
        "--ray-placement",
        "strict-spread",
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--kv-cache-space",
        "0.25",
        "--worker-extension-cls",
        PRODUCER,
        api_server_count=SERVERS,
        env={"RANKCAST_RAY_ADDRESS": cluster.address},
    )
    with server.running():
        response = worker_rpc(server.url, "ray_node")
        assert response.status_code == 200, response.text
        (nodes,) = response.json()["results"]
        assert len(set(nodes)) == 2, f"both stages on one node: {nodes}"
        (remote,) = [n for n in cluster.list_all_nodes() if n is not cluster.head_node]
        remote_rank = nodes.index(remote.node_id)
        assert _greedy(server.url) == want.outputs[0].text
        # The remote rank's events reach every API server.
        readers = open_event_streams(server.url, SERVERS, params={"key": "test.remote"})
        try:
            worker_rpc(server.url, "publish_events", 2, "test.remote", [remote_rank])
            for name, reader in readers.items():
                events = [data for _, data in reader.wait_for(2)]
                assert [(e["rank"], e["payload"]["i"]) for e in events] == [
                    (remote_rank, 0),
                    (remote_rank, 1),
                ], f"API server {name}"
        finally:
            for reader in readers.values():
                reader.close()
        # Losing the node: every API server says so within 5 s.
        cluster.remove_node(remote)
        until_every_server(server.url, SERVERS, 503, 5.0)
        # A node comes back: the restarted engine core places its stages again and serves.
        cluster.add_node(num_cpus=1)
        until_every_server(server.url, SERVERS, 200, 180.0)
        assert _greedy(server.url) == want.outputs[0].text
