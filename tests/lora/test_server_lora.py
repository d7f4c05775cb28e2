"""LoRA through `rankcast serve`: TP=2, two API servers, a static adapter and runtime loads.

The engine owns the registry, so an adapter loaded through one API server is served by both;
every server learns residency from the lifecycle events of each rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rankcast import LLM, LoRARequest, SamplingParams
from tests.entrypoints.notification_clients import open_event_streams
from tests.entrypoints.server_process import ServerProcess

SERVERS = 2
PROMPT = [5, 17, 300, 42, 9]


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, mixed_adapters: list[Path]) -> Iterator[ServerProcess]:
    root = mixed_adapters[0].parent
    proc = ServerProcess(
        str(tiny_llama_dir),
        "--dtype",
        "float32",
        "--kv-cache-space",
        "0.05",
        "--tensor-parallel-size",
        "2",
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"static={mixed_adapters[0]}",
        "--allowed-lora-paths",
        str(root),
        "--allow-runtime-lora-updating",
        api_server_count=SERVERS,
    )
    try:
        proc.wait_healthy()
        yield proc
    finally:
        assert proc.stop() == []


def _each(url: str, path: str) -> dict[str, httpx.Response]:
    seen: dict[str, httpx.Response] = {}
    while len(seen) < SERVERS:
        with httpx.Client(timeout=30) as http:
            response = http.get(f"{url}{path}")
        seen[response.headers["x-rankcast-api-server"]] = response
    return seen


def test_a_static_adapter_is_listed_and_resident_on_every_rank_on_every_server(
    server: ServerProcess,
) -> None:
    for response in _each(server.url, "/v1/models").values():
        data = response.json()["data"]
        (base,) = [m["id"] for m in data if m["parent"] is None]
        assert {m["id"]: m["parent"] for m in data}["static"] == base
    for response in _each(server.url, "/v1/lora_adapters").values():
        (adapter,) = response.json()["data"]
        assert adapter["name"] == "static" and adapter["partial"] is False
        assert [r["rank"] for r in adapter["engines"][0]["ranks"]] == [0, 1]


def test_a_request_naming_an_adapter_is_served_with_it(
    server: ServerProcess, tiny_llama_dir: Path, mixed_adapters: list[Path]
) -> None:
    with LLM(
        str(tiny_llama_dir),
        dtype="float32",
        kv_cache_space_gib=0.05,
        enable_lora=True,
        max_lora_rank=8,
    ) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        request = LoRARequest("static", str(mixed_adapters[0]))
        want = llm.generate([PROMPT], params, lora_request=request)[0].outputs[0].text
        base = llm.generate([PROMPT], params)[0].outputs[0].text
    with httpx.Client(timeout=60) as http:
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        got = http.post(f"{server.url}/v1/completions", json={**body, "model": "static"})
        plain = http.post(f"{server.url}/v1/completions", json=body)
        missing = http.post(f"{server.url}/v1/completions", json={**body, "model": "nope"})
    assert got.json()["choices"][0]["text"] == want
    assert plain.json()["choices"][0]["text"] == base != want
    assert missing.status_code == 404


def test_runtime_load_and_unload_reach_every_server_with_events_from_every_rank(
    server: ServerProcess, mixed_adapters: list[Path], tmp_path: Path
) -> None:
    readers = open_event_streams(
        server.url, SERVERS, params={"type": "lora_adapter_loaded,lora_adapter_evicted"}
    )
    try:
        with httpx.Client(timeout=60) as http:
            loaded = http.post(
                f"{server.url}/v1/load_lora_adapter",
                json={"lora_name": "runtime", "lora_path": str(mixed_adapters[1])},
            )
            assert loaded.status_code == 200, loaded.text
            # The server that answered already knows: the events came before the reply.
            models = http.get(f"{server.url}/v1/models").json()["data"]
            assert "runtime" in {m["id"] for m in models}
            full = http.post(
                f"{server.url}/v1/load_lora_adapter",
                json={"lora_name": "third", "lora_path": str(mixed_adapters[2])},
            )
            assert full.status_code == 400 and "slots" in full.json()["error"]["message"]
            outside = http.post(
                f"{server.url}/v1/load_lora_adapter",
                json={"lora_name": "x", "lora_path": str(tmp_path)},
            )
            assert outside.status_code == 400
            assert "allowed roots" in outside.json()["error"]["message"]
            unloaded = http.post(
                f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "runtime"}
            )
            assert unloaded.status_code == 200
            unknown = http.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "zz"})
            assert unknown.status_code == 404
        for reader in readers.values():
            events = [(d["type"], d["rank"], d.get("reason")) for _, d in reader.wait_for(4)]
            assert events == [
                ("lora_adapter_loaded", 0, None),
                ("lora_adapter_loaded", 1, None),
                ("lora_adapter_evicted", 0, "unload"),
                ("lora_adapter_evicted", 1, "unload"),
            ]
    finally:
        for reader in readers.values():
            reader.close()
    for response in _each(server.url, "/v1/lora_adapters").values():
        assert [a["name"] for a in response.json()["data"]] == ["static"]


def _lines(text: str, prefix: str) -> list[str]:
    return sorted(
        line for line in text.splitlines() if line.startswith(prefix) and "_created" not in line
    )


def _requests_info(text: str) -> dict[str, list[str]]:
    """What a router reads: of the `vllm:lora_requests_info` series, the largest value wins;
    adapter lists are comma-separated."""
    import re

    best, labels = -1.0, {}
    for line in text.splitlines():
        if line.startswith("vllm:lora_requests_info{"):
            value = float(line.rsplit(" ", 1)[1])
            if value > best:
                best = value
                labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
    return {
        key: [a for a in labels.get(f"{key}_lora_adapters", "").split(",") if a]
        for key in ("running", "waiting")
    }


def test_residency_metrics_agree_on_every_server_and_running_adapters_show(
    server: ServerProcess,
) -> None:
    import threading
    import time

    views = {}
    for index, response in _each(server.url, "/metrics").items():
        text = response.text
        loaded = _lines(text, "vllm:lora_adapter_loaded{")
        assert [line.split("rank=")[1][:3] for line in loaded] == ['"0"', '"1"']
        assert all('adapter_name="static"' in line and 'level="gpu"' in line for line in loaded)
        assert _lines(text, "vllm:max_gpu_lora_adapters")[0].endswith(" 2.0")
        assert _lines(text, "vllm:num_gpu_loaded_lora_adapters")[0].endswith(" 1.0")
        events = _lines(text, 'rankcast:lora_adapter_events_total{adapter_name="static"')
        assert events == [
            'rankcast:lora_adapter_events_total{adapter_name="static",event="loaded",reason=""} 2.0'
        ]
        views[index] = (
            loaded,
            events,
            _lines(text, "vllm:lora_adapter_load_seconds_count"),
            _lines(text, "rankcast:lora_adapter_events_total"),
        )
    assert len(set(map(str, views.values()))) == 1, "every server reports the same series"

    body = {"model": "static", "prompt": PROMPT, "max_tokens": 300, "ignore_eos": True}
    worker = threading.Thread(
        target=lambda: httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    )
    worker.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            info = _requests_info(httpx.get(f"{server.url}/metrics").text)
            if info["running"] == ["static"]:
                break
            assert time.monotonic() < deadline, f"running adapters never showed: {info}"
            time.sleep(0.05)
    finally:
        worker.join()
    deadline = time.monotonic() + 30
    while _requests_info(httpx.get(f"{server.url}/metrics").text)["running"]:
        assert time.monotonic() < deadline, "the finished request still counts as running"
        time.sleep(0.1)
