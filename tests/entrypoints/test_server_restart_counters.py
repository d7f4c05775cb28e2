"""Counters that mirror engine totals never go backwards when one of two data-parallel engine
cores is killed and restarted, on either of two API servers: the routing counters
(`rankcast:routing_*`, set from the engine's stats) and the notification counts by type and key
(`rankcast:engine_notifications_total`, started from each engine's snapshot, then counted from
its stream).

A restarted engine counts from zero again, and its stats and snapshot carry only what the new
incarnation did, so a counter set from them rather than added to what it showed falls back. To
show it, the restarted engine must report, after the restart, a reason or a type it had
reported more of before:

- routing: adapter `a`'s requests, always routed to engine 0 (which holds `a`) for the same
  reason, three before the restart and two after;
- notifications: the adapter loads and weight loads every engine publishes at start. Two
  engines' worth were counted before; the new incarnation alone publishes fewer.

An API server reconnecting to the new incarnation at once hears its start-up events on the
stream, which only adds. One that hears of the restart late (busy, or here held with SIGSTOP
until the new incarnation has published them) takes them from the snapshot instead: that is
where a count set from the engine's ledger rather than added to would fall back, and what
tests/reliability/test_engine_restart.py (one engine, servers that reconnect at once) cannot
see."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rankcast.engine_client.engine_router import EngineRouter
from rankcast.engine_client.engine_views import EngineViews
from tests.entrypoints.notification_clients import engine_snapshot, scrape_each
from tests.entrypoints.server_process import ServerProcess, tiny_model_args
from tests.lora.conftest import make_adapter
from tests.lora.router_view import each_server
from tests.routing.kv_stream import free_port_pair, wait_for

SERVERS = 2
PREFIX = [(7 * i) % 240 + 5 for i in range(20 * 16)]  # 320 tokens: 20 whole blocks
# Every counter sample: the routing and notification counts, and the other mirrors of engine
# totals (prefix-cache queries and hits, where each adapter's requests found it) with them.
COUNTERS = re.compile(r"^((?:vllm|rankcast):\w+_total(?:\{[^}]*\})?) (\S+)$", re.M)


def _question(i: int) -> list[int]:
    return [*PREFIX, 3, i]


# Adapter a's requests go to engine 0, which holds it; the decision's reason is "adapter" when
# the least-loaded engine is the other one. Engine 0 is never the less loaded when they are
# sent (each waits for the one before, and nothing else runs), and where the loads are equal
# the tie goes by a hash of the request: these questions hash to engine 1. So every one of
# them is an "adapter" decision, before the restart and after it.
TIED = {0: 0, 1: 0}
QUESTIONS = [
    q
    for q in map(_question, range(64))
    if EngineRouter(EngineViews(2))._cheapest(TIED, q, "a") == 1
]


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """Two engines with one slot and two host places each; of the six adapters, engine 0 starts
    with a and f, engine 1 with b and g (round robin, the first two of each share); h and i
    are on disk only."""
    root = tmp_path_factory.mktemp("restart-adapters")
    make_adapter(tiny_llama_dir, root / "r4", rank=4, alpha=8)
    modules = [f"{name}={root / 'r4'}" for name in "abfghi"]
    replay = free_port_pair()  # engine i answers snapshot requests on replay + i
    proc = ServerProcess(
        *tiny_model_args(tiny_llama_dir),
        "--data-parallel-size=2",
        "--enable-lora",
        "--max-loras=1",
        "--max-cpu-loras=2",
        "--max-lora-rank=8",
        "--lora-modules",
        *modules,
        "--notification-events-endpoint",
        f"tcp://127.0.0.1:{free_port_pair()}",
        "--notification-events-replay-endpoint",
        f"tcp://127.0.0.1:{replay}",
        api_server_count=SERVERS,
    )
    proc.replay_endpoint = f"tcp://127.0.0.1:{replay}"  # type: ignore[attr-defined]
    with proc.running():
        yield proc


def _complete(url: str, prompt: list[int], model: str | None) -> str:
    """The engine that served a two-token completion."""
    body: dict[str, object] = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    if model is not None:
        body["model"] = model
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.headers["x-rankcast-engine"]


def _counters(url: str) -> dict[str, dict[str, float]]:
    """Per API server, every counter sample."""
    return {
        server: {m.group(1): float(m.group(2)) for m in COUNTERS.finditer(text)}
        for server, text in scrape_each(url, SERVERS).items()
    }


def _decisions(counts: dict[str, float], engine: str) -> float:
    return sum(
        value
        for series, value in counts.items()
        if series.startswith(f'rankcast:routing_decisions_total{{engine="{engine}"')
    )


def _went_back(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> list[str]:
    return [
        f"API server {server}: {series} {value:g} -> {after[server].get(series, 0.0):g}"
        for server, counts in before.items()
        for series, value in counts.items()
        if after[server].get(series, 0.0) < value
    ]


def _published_start_up(replay_endpoint: str) -> bool:
    """Whether engine 0's second incarnation has sent its adapter and weight loads (to no API
    server yet: its snapshot's ledger holds them)."""
    snapshot = engine_snapshot(replay_endpoint)
    sent = {(total.type, total.key) for total in snapshot.notifications.totals}
    start_up = {("lora_adapter_loaded", ""), ("custom", "rankcast.weights_loaded")}
    return snapshot.incarnation == 1 and start_up <= sent


def _engine_back(url: str, incarnation: int) -> bool:
    """Whether every API server sees engine 0 up under `incarnation`."""
    for response in each_server(url, SERVERS, "/health").values():
        engines = response.json().get("engines", [])
        if not any(
            e["engine"] == 0 and e["up"] and e["incarnation"] == incarnation for e in engines
        ):
            return False
    return True


def test_routing_and_notification_counters_never_go_back_across_an_engine_restart(
    server: ServerProcess,
) -> None:
    """kill -9 of engine 0 while both API servers are held, so that both hear of its next
    incarnation only after it has published its start-up events (see the module's docstring)."""
    assert len(QUESTIONS) >= 5
    # Three "adapter" decisions for engine 0, the last two expecting (and finding) the prefix
    # the first cached; then two requests for adapters on disk, read and moved to a slot
    # wherever they go: adapter loads beyond those each engine made at start.
    for question in QUESTIONS[:3]:
        assert _complete(server.url, question, "a") == "0"
    for name in "hi":
        _complete(server.url, [11, 12, 13], name)
    wait_for(
        lambda: all(_decisions(c, "0") >= 3 for c in _counters(server.url).values()),
        "both API servers to count engine 0's decisions",
    )
    before = _counters(server.url)

    api_servers = [server.pid_of(f"api_server_{i}") for i in range(SERVERS)]
    for pid in api_servers:
        os.kill(pid, signal.SIGSTOP)
    try:
        os.kill(server.pid_of("engine_core_dp0"), signal.SIGKILL)
        wait_for(
            lambda: _published_start_up(server.replay_endpoint),  # type: ignore[attr-defined]
            "engine 0's next incarnation to publish its start-up events",
            60,
        )
    finally:
        for pid in api_servers:
            os.kill(pid, signal.SIGCONT)
    wait_for(lambda: _engine_back(server.url, 1), "engine 0's next incarnation on both servers", 60)
    # The new incarnation reports two of the same decisions (and a prefix expected and found
    # once): fewer than before, so only a counter that adds them to what it showed holds.
    for question in QUESTIONS[3:5]:
        assert _complete(server.url, question, "a") == "0"
    wanted = {name: _decisions(counts, "0") + 2 for name, counts in before.items()}

    def counted() -> bool:
        after = _counters(server.url)
        return bool(_went_back(before, after)) or all(
            _decisions(counts, "0") == wanted[name] for name, counts in after.items()
        )

    wait_for(counted, "both API servers to count the new incarnation's decisions")
    after = _counters(server.url)
    assert _went_back(before, after) == []
    # The family was published on both sides of the restart (engine 0 loaded a and f again).
    loaded = 'rankcast:engine_notifications_total{key="",type="lora_adapter_loaded"}'
    assert all(after[name][loaded] > before[name][loaded] for name in before), (before, after)
