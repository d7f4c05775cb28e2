"""vllm-router's `kv_aware` policy in front of two `rankcast serve` instances, fed by their
vLLM-format KV events: repeated chats sharing a long system prompt go to the instance that
holds the prefix, the router's own hit counter counting them; after `kill -9` of that
instance's engine core, the dead incarnation's blocks give no hit once the new one serves."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.server_process import (
    TCP_ESTABLISHED,
    ServerProcess,
    free_port,
    sockets_on_port,
)
from tests.routing.kv_stream import replay, wait_for
from tests.routing.vllm_router import find_or_install, lookups, running_router

MODEL = "tiny"
SYSTEM = " ".join(f"Rule {i}: answer politely and briefly about topic {i}." for i in range(24))


def _instance(model_dir: Path, pub: int, replay: int) -> ServerProcess:
    config = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{pub}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
    }
    return ServerProcess(
        str(model_dir),
        "--dtype=float32",
        "--kv-cache-space=0.05",
        f"--served-model-name={MODEL}",
        f"--kv-events-config={json.dumps(config)}",
        api_server_count=1,
    )


def _served(server: ServerProcess) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total{")
    )


def _published_stores(ports: list[tuple[int, int]]) -> int:
    """`BlockStored` events the engines' current incarnations have published, as their
    replay sockets hold them: a chat's blocks reach the router's index on the same PUB
    frame, so a chat sent after this count moved is routed by an index that has them (the
    router counts no event it applied, and a chat sent at once would race the frame)."""
    return sum(
        1
        for _, endpoint in ports
        for frame in replay(f"tcp://127.0.0.1:{endpoint}", 0)
        for event in frame.batch()[1]
        if event["type"] == "BlockStored"
    )


def _chat(router: str, question: int) -> None:
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Question {question}?"},
        ],
        "max_tokens": 2,
        "temperature": 0,
    }
    answer = httpx.post(f"{router}/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text


@pytest.fixture(scope="module")
def router_executable() -> Path:
    executable, why = find_or_install()
    if executable is None:
        pytest.skip(why)
    return executable


@pytest.fixture
def fleet(tiny_chat_dir: Path) -> Iterator[tuple[list[ServerProcess], list[tuple[int, int]]]]:
    ports = [(free_port(), free_port()) for _ in range(2)]
    servers = [_instance(tiny_chat_dir, pub, replay) for pub, replay in ports]
    with servers[0].running(), servers[1].running():
        yield servers, ports


def test_kv_aware_routes_to_the_prefix_holder_and_forgets_a_dead_incarnation(
    router_executable: Path,
    fleet: tuple[list[ServerProcess], list[tuple[int, int]]],
    tmp_path: Path,
) -> None:
    servers, ports = fleet
    metrics_port = free_port()
    args = ["--policy", "kv_aware", "--prometheus-port", str(metrics_port)]
    args += ["--worker-urls", *(s.url for s in servers)]
    for server, (pub, replay_port) in zip(servers, ports, strict=True):
        args += ["--kv-event-source", f"{server.url}=tcp://127.0.0.1:{pub}"]
        args += ["--kv-event-replay-source", f"{server.url}=tcp://127.0.0.1:{replay_port}"]
    args += ["--kv-event-block-size", "16", "--kv-event-model", MODEL]
    log = tmp_path / "vllm-router.log"
    metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    with running_router(router_executable, args, free_port(), log) as router:
        # Ready is not subscribed: the router's SUB sockets connect after it answers, and a
        # frame published before one has its subscription is not sent to it (it would find the
        # lost batch only when the next one showed the gap). Its subscription follows the
        # connection's handshake at once.
        wait_for(
            lambda: all(sockets_on_port(pub, TCP_ESTABLISHED) for pub, _ in ports),
            "the router to connect to both engines' event streams",
            30,
        )
        _chat(router, 0)
        wait_for(lambda: _published_stores(ports) > 0, "the first chat's blocks published", 30)
        for question in range(1, 6):
            _chat(router, question)
        served = [_served(s) for s in servers]
        assert sorted(served) == [0, 6], f"every chat went to the prefix holder: {served}"
        counted = lookups(metrics)
        assert counted.get("hit") == 5, f"the router counted its hits: {counted}"
        holder = servers[served.index(6)]

        old = holder.pid_of("engine_core_dp0")
        os.kill(old, signal.SIGKILL)
        # Once the new incarnation serves and the router has heard it start from seq 0.
        wait_for(lambda: "incarnation 1" in log.read_text(), "the router to see the restart", 120)

        def serving() -> bool:
            try:
                return httpx.get(f"{holder.url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(serving, "the restarted engine core to serve", 120)
        before = lookups(metrics)
        assert _published_stores(ports) == 0, "the new incarnation starts with no blocks"
        _chat(router, 100)
        wait_for(lambda: _published_stores(ports) > 0, "the new blocks published", 30)
        after = lookups(metrics)
        assert after.get("hit", 0) == before.get("hit", 0), (
            f"a hit counted for the dead incarnation's blocks: {before} -> {after}"
        )
        _chat(router, 101)
        assert lookups(metrics).get("hit", 0) == after.get("hit", 0) + 1, "the new blocks hit"
