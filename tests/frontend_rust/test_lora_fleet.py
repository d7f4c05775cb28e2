"""Same numbers on every server: two Python API servers and one Rust API server in front of a
TP=3 engine serving LoRA adapters report the engine-derived series (load, cache, notification
totals and drops, weight loads, adapter residency, requests per adapter, lifecycle counts and
load times) line for line alike, at start, after an adapter load and an eviction sequence, and
after the Rust server is killed and restarted (it catches up from the engine's snapshot); the
Rust server's `/v1/events` carries the same lifecycle events with the same ids in the same order.

The tests run in file order on one fleet, as an operator's session would.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import write_tiny_model
from tests.entrypoints.notification_clients import families, open_event_streams, scrape_each
from tests.entrypoints.server_process import ServerProcess, tiny_model_args
from tests.frontend_rust.rust_fleet import frontend_env, kill_and_wait_for_restart
from tests.lora.conftest import make_adapter

pytestmark = pytest.mark.scenario

SERVERS = {"0", "1", "2"}  # two Python servers, then the Rust one
RUST = "2"
PROMPT = [5, 17, 300, 42, 9]
# What item 5 of the issue names, each required on every server; every other family the Rust
# server exposes is compared too.
REQUIRED = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
    "vllm:lora_adapter_loaded",
    "vllm:lora_requests_info",
    "vllm:num_gpu_loaded_lora_adapters",
    "vllm:num_cpu_loaded_lora_adapters",
    "vllm:max_gpu_lora_adapters",
    "rankcast:engine_notifications_total",
    "rankcast:worker_notifications_dropped_total",
    "rankcast:worker_weights_load_seconds",
    "rankcast:lora_adapter_events_total",
    "vllm:lora_adapter_load_seconds",
)
LIFECYCLE = ",".join(f"lora_adapter_{e}" for e in ("loaded", "activated", "evicted"))


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path) -> list[Path]:
    """A tiny model whose 6 heads and 3 KV heads split over three ranks, and three adapters."""
    root = tmp_path_factory.mktemp("tp3-lora")
    model = write_tiny_model(
        root / "model",
        tokenizer_from=embedded_model_dir,
        hidden_size=96,
        intermediate_size=192,
        num_attention_heads=6,
        num_key_value_heads=3,
    )
    paths = [model]
    for name, rank in (("a", 4), ("b", 8), ("c", 2)):
        make_adapter(model, root / name, rank=rank, alpha=2 * rank)
        paths.append(root / name)
    return paths


@pytest.fixture(scope="module")
def fleet(adapters: list[Path]) -> Iterator[ServerProcess]:
    model, a, _, _ = adapters
    server = ServerProcess(
        *tiny_model_args(
            model,
            "--tensor-parallel-size", "3", "--enable-lora", "--max-loras", "1",
            "--max-cpu-loras", "3", "--max-lora-rank", "8", "--lora-modules", f"a={a}",
            "--allowed-lora-paths", str(a.parent), "--allow-runtime-lora-updating",
        ),
        api_server_count=2,
        rust_api_server_count=1,
        env=frontend_env(),
    )  # fmt: skip
    with server.running():
        yield server


def _agreed(url: str, timeout_s: float = 30) -> dict[str, list[str]]:
    """Wait until the three servers report the same lines for every family the Rust server
    exposes (REQUIRED among them); return those families. The servers follow one broadcast,
    but not in the same microsecond, so they may differ for a moment."""
    deadline = time.monotonic() + timeout_s
    while True:
        bodies = {i: families(text) for i, text in scrape_each(url, len(SERVERS)).items()}
        rust = bodies[RUST]
        missing = [name for name in REQUIRED if name not in rust]
        assert not missing, f"the Rust server lacks {missing}"
        differing = {
            name: {server: body.get(name) for server, body in bodies.items()}
            for name in rust
            if any(body.get(name) != rust[name] for body in bodies.values())
        }
        if not differing:
            return rust
        assert time.monotonic() < deadline, "the servers disagree:\n" + "\n".join(
            f"{name}:\n" + "\n".join(f"  {s}: {lines}" for s, lines in sorted(views.items()))
            for name, views in differing.items()
        )
        time.sleep(0.2)


def _samples(exposed: dict[str, list[str]], name: str) -> list[str]:
    return [line for line in exposed[name] if not line.startswith("#")]


def _resident(exposed: dict[str, list[str]]) -> set[tuple[str, str]]:
    """(adapter, level) pairs of `vllm:lora_adapter_loaded`."""
    out = set()
    for line in _samples(exposed, "vllm:lora_adapter_loaded"):
        adapter = line.split('adapter_name="')[1].split('"')[0]
        level = line.split('level="')[1].split('"')[0]
        out.add((adapter, level))
    return out


def _complete(url: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def test_at_start_every_server_reports_the_same_adapter_and_engine_series(
    fleet: ServerProcess,
) -> None:
    exposed = _agreed(fleet.url)
    assert _resident(exposed) == {("a", "gpu"), ("a", "cpu")}
    loaded = _samples(exposed, "vllm:lora_adapter_loaded")
    assert sorted(line.split('rank="')[1][0] for line in loaded) == ["0", "0", "1", "1", "2", "2"]
    assert _samples(exposed, "vllm:max_gpu_lora_adapters")[0].endswith(" 1.0")
    weights = _samples(exposed, "rankcast:worker_weights_load_seconds")
    assert len(weights) == 3, "one weight-load figure per rank"


def test_a_load_and_an_eviction_sequence_reach_every_server_alike(
    fleet: ServerProcess, adapters: list[Path]
) -> None:
    """Loading b and c (through a Python server: the Rust one does not serve runtime loads), then
    requests on b, a and c through whichever server the port picks: one device slot, so each
    switch evicts; every server, the Rust one included, streams the same events with the same
    ids and reports the same series."""
    readers = open_event_streams(fleet.url, len(SERVERS), params={"type": LIFECYCLE})
    try:
        for name, path in (("b", adapters[2]), ("c", adapters[3])):
            for _ in range(50):
                response = httpx.post(
                    f"{fleet.url}/v1/load_lora_adapter",
                    json={"lora_name": name, "lora_path": str(path)},
                    timeout=60,
                )
                if response.headers["x-rankcast-api-server"] != RUST:
                    break
            assert response.status_code == 200, response.text
        for model in ("b", "a", "c", "b"):
            response = _complete(fleet.url, model)
            assert response.status_code == 200, response.text
        # Every rank loads b and c into the host tier (the device slot is a's); each of the
        # four switches evicts the previous adapter from the device and activates the next.
        expected = 2 * 3 + 4 * 2 * 3
        streams = {server: r.wait_for(expected)[:expected] for server, r in readers.items()}
    finally:
        for reader in readers.values():
            reader.close()
    ids = {server: [event_id for event_id, _ in events] for server, events in streams.items()}
    assert ids[RUST] == ids["0"] == ids["1"], "the same ids, in the same order"
    data = {server: [d for _, d in events] for server, events in streams.items()}
    assert data[RUST] == data["0"] == data["1"], "the same events"
    evicted = [d for d in data[RUST] if d["type"] == "lora_adapter_evicted"]
    assert {(d["adapter_name"], d["reason"]) for d in evicted} >= {("a", "lru"), ("b", "lru")}
    assert {d["rank"] for d in evicted} == {0, 1, 2}

    exposed = _agreed(fleet.url)
    assert ("b", "gpu") in _resident(exposed)
    assert _resident(exposed) == {("b", "gpu"), ("a", "cpu"), ("b", "cpu"), ("c", "cpu")}
    events = _samples(exposed, "rankcast:lora_adapter_events_total")
    a_evicted = '{adapter_name="a",event="evicted",reason="lru"} 6.0'  # twice, on 3 ranks
    assert f"rankcast:lora_adapter_events_total{a_evicted}" in events
    loads = _samples(exposed, "vllm:lora_adapter_load_seconds")
    assert any('transition="cpu_to_gpu"' in line and "_count" in line for line in loads)


def test_a_killed_rust_server_comes_back_with_the_same_numbers(fleet: ServerProcess) -> None:
    before = _agreed(fleet.url)
    kill_and_wait_for_restart(fleet)
    after = _agreed(fleet.url, timeout_s=60)
    assert {name: after[name] for name in REQUIRED} == {name: before[name] for name in REQUIRED}
