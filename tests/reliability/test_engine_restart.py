"""Supervised restart on the embedded SmolLM2 with TP=3 ranks and 2 API servers: kill -9 the
engine core, then one of its ranks; each time the stream in flight ends with an error (no hang),
every API server answers 503, then serves again within 20 s under the next incarnation, the
event stream says it restarted, and no counter goes backwards.

One session told in steps (its engine's incarnations count up through the file)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from rankcast.process import process_is_alive
from tests.entrypoints.notification_clients import open_event_streams, scrape_each, worker_rpc
from tests.entrypoints.server_process import ServerProcess
from tests.reliability.fleet import StreamedCompletion, until_every_server

pytestmark = pytest.mark.scenario

SERVERS = 2
SERVE_AGAIN_S = 20.0  # the bound: a restarted engine serves within this


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "--tensor-parallel-size",
        "3",
        "--max-model-len",
        "512",
        "--kv-cache-space",
        "0.25",
        "--worker-extension-cls",
        "tests.worker.producers:EventProducer",
        api_server_count=SERVERS,
    )
    with proc.running():
        yield proc


def _counters(url: str) -> dict[str, dict[str, float]]:
    """Per API server, every counter sample (`vllm:` and `rankcast:`, the fleet's own counts
    and the mirrors of engine totals alike): none may go backwards."""
    wanted = re.compile(r"^((?:vllm|rankcast):\w+_total(?:\{[^}]*\})?) (\S+)$", re.M)
    return {
        server: {m.group(1): float(m.group(2)) for m in wanted.finditer(text)}
        for server, text in scrape_each(url, SERVERS).items()
    }


def _chat(url: str) -> str:
    with httpx.Client(timeout=60) as http:
        response = http.post(
            f"{url}/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 8,
                "temperature": 0,
            },
        )
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


def _kill_and_recover(server: ServerProcess, role: str, incarnation: int) -> None:
    _chat(server.url)  # some tokens counted before the failure
    worker_rpc(server.url, "publish_events", 1, "test.before")  # one event per rank
    readers = open_event_streams(server.url, SERVERS, headers={"Last-Event-ID": "0:0:-1"})
    try:
        last_id = next(iter(readers.values())).wait_for(3)[-1][0]
    finally:
        for reader in readers.values():
            reader.close()
    assert last_id.startswith(f"0:{incarnation - 1}:")
    before = _counters(server.url)
    stream = StreamedCompletion(server.url, max_tokens=400)
    assert stream.first.wait(60), "the stream should be running before the kill"
    engine = server.pid_of("engine_core_dp0")
    os.kill(server.pid_of(role), signal.SIGKILL)
    killed = time.monotonic()
    # The request in flight ends with an error, not a hang; every server answers 503.
    stream.thread.join(30)
    assert not stream.thread.is_alive(), "the stream in flight must end"
    assert stream.events[-1] == "[DONE]"
    assert any("error" in json.loads(e) for e in stream.events[:-1]), stream.events[-3:]
    detect = until_every_server(server.url, SERVERS, 503, 10)
    # Serving again, under the next incarnation, within the bound.
    left = SERVE_AGAIN_S - (time.monotonic() - killed)
    again = until_every_server(server.url, SERVERS, 200, left)
    print(f"\n{role} killed: every server 503 after {detect:.1f} s, 200 after {again:.1f} s more")
    assert not process_is_alive(engine)
    assert server.pid_of("engine_core_dp0") != engine
    assert _chat(server.url)
    # A reader resuming from the dead incarnation is told; new events carry the new one.
    readers = open_event_streams(server.url, SERVERS, headers={"Last-Event-ID": last_id})
    try:
        worker_rpc(server.url, "publish_events", 1, "test.after")
        for name, reader in readers.items():
            ids = [event_id for event_id, _ in reader.wait_for(3)]
            assert all(i.startswith(f"0:{incarnation}:") for i in ids), f"API server {name}"
            (gap,) = [data for kind, data in reader.controls if kind == "replay_gap"]
            assert f"incarnation {incarnation - 1} -> {incarnation}" in gap["message"]
    finally:
        for reader in readers.values():
            reader.close()
    # Counters never go backwards on any server, whichever incarnation counted (the engine
    # totals, prefix-cache queries and hits among them, start from zero in a new incarnation).
    after = _counters(server.url)
    assert any("prefix_cache_queries" in series for series in before["0"]), before["0"]
    for name, counts in before.items():
        for series, value in counts.items():
            assert after[name].get(series, 0.0) >= value, f"{series} went back on server {name}"


def test_a_killed_engine_core_is_restarted_and_served_again(server: ServerProcess) -> None:
    _kill_and_recover(server, "engine_core_dp0", incarnation=1)


def test_a_killed_rank_restarts_its_engine_core(server: ServerProcess) -> None:
    _kill_and_recover(server, "worker_dp0_pp0_tp1", incarnation=2)
