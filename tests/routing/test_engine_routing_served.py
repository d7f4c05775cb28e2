"""Routing by the channel's state on real processes: two engine cores (DP=2, the tiny model)
behind two API servers, `--routing-policy auto`. Chats sharing a long prefix all go to the
engine that caches it, an adapter's requests to the engine holding it in a device slot, every
API server choosing alike and counting every server's choices identically; a dead engine is
skipped at once."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.entrypoints.notification_clients import open_event_streams
from tests.entrypoints.server_process import ServerProcess
from tests.lora.conftest import make_adapter
from tests.lora.router_view import each_server
from tests.routing.kv_stream import wait_for

SERVERS = 2
PREFIX = [(7 * i) % 240 + 5 for i in range(20 * 16)]  # 320 tokens: 20 whole blocks


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("routed-adapters")
    make_adapter(tiny_llama_dir, root / "alpha", rank=4, alpha=8)
    make_adapter(tiny_llama_dir, root / "beta", rank=2, alpha=4)
    make_adapter(tiny_llama_dir, root / "gamma", rank=8, alpha=8)
    proc = ServerProcess(
        str(tiny_llama_dir),
        "--dtype=float32",
        "--kv-cache-space=0.05",
        "--data-parallel-size=2",
        "--routing-policy=auto",
        "--enable-lora",
        "--max-loras=1",
        "--max-lora-rank=8",
        "--lora-modules",
        f"alpha={root / 'alpha'}",
        f"beta={root / 'beta'}",
        f"gamma={root / 'gamma'}",
        api_server_count=SERVERS,
    )
    with proc.running():
        yield proc


def _complete(url: str, prompt: list[int], model: str | None = None) -> tuple[str, str]:
    """(engine, API server) that served a one-token completion."""
    body: dict[str, object] = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    if model is not None:
        body["model"] = model
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.headers["x-rankcast-engine"], answer.headers["x-rankcast-api-server"]


def _routing_series(text: str) -> list[str]:
    return sorted(
        line
        for line in text.splitlines()
        if line.startswith(
            ("rankcast:routing_", "rankcast:lora_requests_found", "rankcast:lora_ev")
        )
        and "{" in line
    )


def _engines_holding(adapter: dict[str, Any], tier: str) -> set[str]:
    """The engines where every rank holds the adapter in `tier` (/v1/lora_adapters)."""
    return {
        str(engine["engine"])
        for engine in adapter["engines"]
        if engine["ranks"] and all(tier in rank["tiers"] for rank in engine["ranks"])
    }


def _value(lines: list[str], prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(prefix))


def test_prefix_adapter_and_a_dead_engine_decide_the_engine(server: ServerProcess) -> None:
    # ---- the prefix: the engine that cached it gets every request that shares it ----
    readers = open_event_streams(server.url, SERVERS, params={"type": "kv_blocks_stored"})
    try:
        holder, _ = _complete(server.url, [*PREFIX, 1])
        wait_for(
            lambda: all(
                any(str(e.get("engine_index")) == holder for _, e in r.events)
                for r in readers.values()
            ),
            "both API servers to hear the prefix stored",
        )
    finally:
        for reader in readers.values():
            reader.close()
    engines = {_complete(server.url, [*PREFIX, 2, i])[0] for i in range(8)}
    assert engines == {holder}, "every request sharing the prefix went to its holder"
    seen: dict[str, str] = {}
    while len(seen) < SERVERS:  # the same request through each API server
        engine, api_server = _complete(server.url, [*PREFIX, 3])
        seen[api_server] = engine
    assert set(seen.values()) == {holder}, f"the API servers chose differently: {seen}"

    # ---- at start each engine holds its share of --lora-modules, round robin: one slot
    # and one host place each, so alpha on engine 0, beta on engine 1, gamma on neither ----
    adapters = httpx.get(f"{server.url}/v1/lora_adapters", timeout=30).json()["data"]
    held = {a["name"]: _engines_holding(a, "device") for a in adapters}
    assert held == {"alpha": {"0"}, "beta": {"1"}, "gamma": set()}, adapters

    # ---- the adapter: the engine holding it in a device slot gets its requests ----
    # The engine that loads gamma for its first request holds it there; the other keeps what
    # it had.
    name = "gamma"
    first, _ = _complete(server.url, [11, 12, 13], name)

    def on_device() -> bool:
        for response in each_server(server.url, SERVERS, "/v1/lora_adapters").values():
            (adapter,) = [a for a in response.json()["data"] if a["name"] == name]
            for engine in adapter["engines"]:
                ranks = engine["ranks"]
                device = bool(ranks) and all("device" in r["tiers"] for r in ranks)
                if device != (str(engine["engine"]) == first):
                    return False
        return True

    wait_for(on_device, f"both API servers to see {name} in a device slot of one engine")
    engines = {_complete(server.url, [20 + i, 21, 22, 23], name)[0] for i in range(8)}
    assert engines == {first}, "the adapter's requests went where it is loaded"

    # ---- what every API server reports: the same counts, and the router was right ----
    def agreed() -> bool:
        views = [
            _routing_series(r.text) for r in each_server(server.url, SERVERS, "/metrics").values()
        ]
        return (
            len({str(v) for v in views}) == 1
            and _value(views[0], "rankcast:routing_decisions_total") >= 19
        )

    wait_for(agreed, "both API servers to report the same routing counts")
    lines = _routing_series(httpx.get(f"{server.url}/metrics", timeout=30).text)
    decisions = {
        (m.group(1), m.group(2)): float(line.rsplit(" ", 1)[1])
        for line in lines
        if (m := re.search(r'routing_decisions_total\{engine="(\d)",reason="(\w+)"\}', line))
    }
    assert decisions.get((holder, "prefix"), 0) >= 1, f"the prefix decided a case: {decisions}"
    assert decisions.get((first, "adapter"), 0) >= 1, f"the adapter decided a case: {decisions}"
    found_adapter = _value(lines, f'rankcast:lora_requests_found_total{{adapter_name="{name}"')
    assert found_adapter == 9, "each of the adapter's requests says where it found it"
    expected = _value(lines, "rankcast:routing_expected_prefix_tokens_total")
    found = _value(lines, "rankcast:routing_hit_prefix_tokens_total")
    assert expected >= 8 * 320 and found == expected, (expected, found)

    # ---- a dead engine is skipped at once ----
    os.kill(server.pid_of(f"engine_core_dp{holder}"), signal.SIGKILL)
    other = "1" if holder == "0" else "0"

    def skipped() -> bool:
        try:
            return _complete(server.url, [*PREFIX, 4])[0] == other
        except (AssertionError, httpx.HTTPError):
            return False

    wait_for(skipped, "a request to reach the live engine", 30)
    for i in range(4):
        assert _complete(server.url, [*PREFIX, 5, i])[0] == other
