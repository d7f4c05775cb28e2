"""The LoRA signals KV- and adapter-aware routers read, from a real server: the blocks a
request under an adapter caches are published under the adapter's name (what clients send as
`model`, what vllm-router and llm-d hash with the tokens), and `/metrics` parsed the way
llm-d's LoRA scorer parses it says which adapters sit in a device slot, how many, out of how
many."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.server_process import ServerProcess, free_port
from tests.lora.conftest import make_adapter
from tests.routing.kv_stream import replay, wait_for


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("routing-adapters")
    made = []
    for name, rank in (("alpha", 4), ("beta", 2)):
        make_adapter(tiny_llama_dir, root / name, rank=rank, alpha=2 * rank)
        made.append(root / name)
    return made


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, adapters: list[Path]) -> Iterator[tuple[ServerProcess, str]]:
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{free_port()}",
        "replay_endpoint": replay_endpoint,
    }
    proc = ServerProcess(
        str(tiny_llama_dir),
        "--dtype=float32",
        "--kv-cache-space=0.05",
        "--enable-lora",
        "--max-loras=1",
        "--max-cpu-loras=2",
        "--max-lora-rank=8",
        "--lora-modules",
        f"alpha={adapters[0]}",
        f"beta={adapters[1]}",
        f"--kv-events-config={json.dumps(config)}",
        api_server_count=1,
    )
    with proc.running():
        yield proc, replay_endpoint


def scorer_view(text: str) -> dict[str, object]:
    """What llm-d's LoRA scorer takes from one pod's exposition: the adapters in a device slot
    on every rank (level "gpu"; a rank missing it means a request would load it there), the
    count of loaded adapters and the slots."""
    ranks: dict[str, set[str]] = {}
    loaded_on: dict[str, set[str]] = {}
    gauges: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:lora_adapter_loaded":
                ranks.setdefault(sample.labels["rank"], set())
                if sample.labels["level"] == "gpu" and sample.value == 1:
                    loaded_on.setdefault(sample.labels["adapter_name"], set()).add(
                        sample.labels["rank"]
                    )
            elif sample.name in ("vllm:num_gpu_loaded_lora_adapters", "vllm:max_gpu_lora_adapters"):
                gauges[sample.name] = sample.value
    every_rank = set(ranks)
    return {
        "loaded": sorted(a for a, on in loaded_on.items() if on == every_rank),
        "count": gauges["vllm:num_gpu_loaded_lora_adapters"],
        "slots": gauges["vllm:max_gpu_lora_adapters"],
    }


def _complete(url: str, model: str, prompt: list[int]) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code == 200


def test_adapter_blocks_carry_the_adapters_name_and_the_scorer_sees_residency(
    server: tuple[ServerProcess, str],
) -> None:
    proc, replay_endpoint = server
    prompt = list(range(10, 60))  # three whole blocks of 16
    for model in ("alpha", "beta"):
        _complete(proc.url, model, prompt)
        view = scorer_view(httpx.get(f"{proc.url}/metrics", timeout=30).text)
        assert view == {"loaded": [model], "count": 1.0, "slots": 1.0}, view

    def stored() -> list[dict[str, object]]:
        return [
            event
            for frame in replay(replay_endpoint, 0)
            for event in frame.batch()[1]
            if event["type"] == "BlockStored"
        ]

    wait_for(lambda: len({e["lora_name"] for e in stored()}) == 2, "both adapters' blocks")
    by_name = {e["lora_name"]: e for e in stored()}
    assert set(by_name) == {"alpha", "beta"}
    assert by_name["alpha"]["token_ids"] == by_name["beta"]["token_ids"] == prompt[:48]
    assert by_name["alpha"]["block_hashes"] != by_name["beta"]["block_hashes"], "per adapter"
    ids = {by_name[n]["lora_id"] for n in ("alpha", "beta")}
    assert None not in ids and len(ids) == 2

    # Adapter cache observability: one device slot, two adapters taking turns, so each
    # request of the second round brings back an adapter evicted for the other (thrashing).
    for model in ("alpha", "beta"):
        _complete(proc.url, model, prompt)
    text = httpx.get(f"{proc.url}/metrics", timeout=30).text
    found: dict[str, dict[str, float]] = {}
    undone: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "rankcast:lora_requests_found_total":
                found.setdefault(labels["adapter_name"], {})[labels["tier"]] = sample.value
            elif sample.name == "rankcast:lora_evictions_undone_total":
                undone[labels["adapter_name"]] = sample.value
    for name in ("alpha", "beta"):
        assert sum(found[name].values()) == 2, found
        assert set(found[name]) <= {"device", "host", "disk"}
        assert found[name].get("device", 0) <= 1, "the second round never found it in the slot"
        assert undone.get(name, 0) >= 1, undone
