"""LoRA through `rankcast serve`: TP=2, two API servers, a static adapter and runtime loads,
two device slots and a host tier of three.

The engine owns the registry, so an adapter loaded through one API server is served by both;
every server learns residency from the lifecycle events of each rank. The tests run in file
order on one server and build on each other's adapter state, as an operator's session would.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rankcast import LoRARequest, SamplingParams
from tests.entrypoints.notification_clients import open_event_streams, scrape_each, series
from tests.entrypoints.server_process import ServerProcess
from tests.lora.conftest import lora_llm
from tests.lora.router_view import each_server, requests_info

# An operator's session, step by step: each test starts from the adapter state the one above
# left, so the module keeps its file order when the suite runs in random order (conftest.py).
pytestmark = pytest.mark.scenario

SERVERS = 2
PROMPT = [5, 17, 300, 42, 9]
LIFECYCLE = ",".join(
    f"lora_adapter_{e}" for e in ("loaded", "activated", "evicted", "pinned", "unpinned")
)
STATIC_EVENTS = 'rankcast:lora_adapter_events_total{adapter_name="static",'
LORA_SERIES = ("vllm:lora_", "vllm:num_", "vllm:max_gpu_lora", "rankcast:lora_")


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
        "--max-cpu-loras",
        "3",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"static={mixed_adapters[0]}",
        "--allowed-lora-paths",
        str(root),
        "--allow-runtime-lora-updating",
        api_server_count=SERVERS,
    )
    with proc.running():
        yield proc


def http_models(url: str) -> list[str]:
    """The ids /v1/models lists: the base model first, then the adapters."""
    return [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]]


def _event(data: dict[str, Any]) -> tuple[int, str, str, str]:
    """(rank, event, adapter, tier or tier:reason) of one lifecycle event from /v1/events."""
    detail = f"{data['tier']}:{data['reason']}" if "reason" in data else data["tier"]
    return data["rank"], data["type"].removeprefix("lora_adapter_"), data["adapter_name"], detail


def test_a_static_adapter_is_listed_and_resident_on_every_rank_on_every_server(
    server: ServerProcess,
) -> None:
    for response in each_server(server.url, SERVERS, "/v1/models").values():
        data = response.json()["data"]
        (base,) = [m["id"] for m in data if m["parent"] is None]
        assert {m["id"]: m["parent"] for m in data}["static"] == base
    for response in each_server(server.url, SERVERS, "/v1/lora_adapters").values():
        (adapter,) = response.json()["data"]
        assert adapter["name"] == "static" and adapter["partial"] is False
        assert adapter["tiers"] == ["device", "cpu"] and adapter["pinned"] is False
        assert adapter["engines"][0]["ranks"] == [
            {"rank": rank, "tiers": ["device", "cpu"], "pinned": False} for rank in (0, 1)
        ]


def test_a_request_naming_an_adapter_is_served_with_it(
    server: ServerProcess, tiny_llama_dir: Path, mixed_adapters: list[Path]
) -> None:
    with lora_llm(tiny_llama_dir) as llm:
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
    # Responses name the model as the request did: the adapter, or the base model.
    base_name = http_models(server.url)[0]
    assert got.json()["model"] == "static"
    assert plain.json()["model"] == base_name
    streamed = {**body, "model": "static", "stream": True}
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{server.url}/v1/completions", json=streamed) as stream,
    ):
        assert stream.status_code == 200
        lines = [line for line in stream.iter_lines() if line.startswith("data: {")]
        chunks = [json.loads(line[6:]) for line in lines]
    assert chunks and {c["model"] for c in chunks} == {"static"}


def test_an_adapter_cannot_take_the_base_models_name_or_a_taken_one(
    server: ServerProcess, mixed_adapters: list[Path]
) -> None:
    base_name = http_models(server.url)[0]
    with httpx.Client(timeout=60) as http:
        as_base = http.post(
            f"{server.url}/v1/load_lora_adapter",
            json={"lora_name": base_name, "lora_path": str(mixed_adapters[1])},
        )
        taken = http.post(
            f"{server.url}/v1/load_lora_adapter",
            json={"lora_name": "static", "lora_path": str(mixed_adapters[1])},
        )
        again = http.post(
            f"{server.url}/v1/load_lora_adapter",
            json={"lora_name": "static", "lora_path": str(mixed_adapters[0])},
        )
    assert as_base.status_code == 400, as_base.text
    assert as_base.json()["error"]["param"] == "lora_name"
    assert "name of the base model" in as_base.json()["error"]["message"]
    assert taken.status_code == 409, taken.text
    assert "'static' is already loaded from" in taken.json()["error"]["message"]
    assert again.status_code == 200, "the same name from the same path again changes nothing"
    assert http_models(server.url).count("static") == 1


def test_runtime_load_and_unload_reach_every_server_with_events_from_every_rank(
    server: ServerProcess, mixed_adapters: list[Path], tmp_path: Path
) -> None:
    readers = open_event_streams(server.url, SERVERS, params={"type": LIFECYCLE})
    try:
        with httpx.Client(timeout=60) as http:
            loaded = http.post(
                f"{server.url}/v1/load_lora_adapter",
                json={"lora_name": "runtime", "lora_path": str(mixed_adapters[1])},
            )
            assert loaded.status_code == 200, loaded.text
            assert loaded.json()["data"][0]["tiers"] == [
                "device",
                "cpu",
            ]  # a slot was free (engine 0)
            # The server that answered already knows: the events came before the reply.
            models = http.get(f"{server.url}/v1/models").json()["data"]
            assert "runtime" in {m["id"] for m in models}
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
            events = [_event(d) for _, d in reader.wait_for(8)]
            # One gather per call, ranks in order, each rank's events in the order it made them.
            assert events == [
                (0, "loaded", "runtime", "cpu"),
                (0, "activated", "runtime", "device"),
                (1, "loaded", "runtime", "cpu"),
                (1, "activated", "runtime", "device"),
                (0, "evicted", "runtime", "device:unload"),
                (0, "evicted", "runtime", "cpu:unload"),
                (1, "evicted", "runtime", "device:unload"),
                (1, "evicted", "runtime", "cpu:unload"),
            ]
    finally:
        for reader in readers.values():
            reader.close()
    for response in each_server(server.url, SERVERS, "/v1/lora_adapters").values():
        assert [a["name"] for a in response.json()["data"]] == ["static"]


def _lines(text: str, prefix: str) -> list[str]:
    return sorted(
        line for line in text.splitlines() if line.startswith(prefix) and "_created" not in line
    )


def test_residency_metrics_agree_on_every_server_and_running_adapters_show(
    server: ServerProcess,
) -> None:
    views = {}
    for index, response in each_server(server.url, SERVERS, "/metrics").items():
        text = response.text
        loaded = _lines(text, "vllm:lora_adapter_loaded{")
        where = sorted(
            (line.split('level="')[1][:3], line.split('rank="')[1][0]) for line in loaded
        )
        assert where == [("cpu", "0"), ("cpu", "1"), ("gpu", "0"), ("gpu", "1")]
        assert all('adapter_name="static"' in line for line in loaded)
        assert _lines(text, "vllm:max_gpu_lora_adapters")[0].endswith(" 2.0")
        assert _lines(text, "vllm:num_gpu_loaded_lora_adapters")[0].endswith(" 1.0")
        assert _lines(text, "vllm:num_cpu_loaded_lora_adapters")[0].endswith(" 1.0")
        events = _lines(text, 'rankcast:lora_adapter_events_total{adapter_name="static"')
        assert events == [
            f'{STATIC_EVENTS}event="activated",reason=""}} 2.0',
            f'{STATIC_EVENTS}event="loaded",reason=""}} 2.0',
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
            info = requests_info(httpx.get(f"{server.url}/metrics").text)
            if info["running"] == ["static"]:
                break
            assert time.monotonic() < deadline, f"running adapters never showed: {info}"
            time.sleep(0.05)
    finally:
        worker.join()
    deadline = time.monotonic() + 30
    while requests_info(httpx.get(f"{server.url}/metrics").text)["running"]:
        assert time.monotonic() < deadline, "the finished request still counts as running"
        time.sleep(0.1)


def _complete(url: str, model: str, max_tokens: int = 4) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
    with httpx.Client(timeout=120) as http:
        return http.post(f"{url}/v1/completions", json=body)


def _lora_views(url: str) -> dict[str, list[str]]:
    return {i: series(text, *LORA_SERIES) for i, text in scrape_each(url, SERVERS).items()}


def test_an_eviction_sequence_between_two_scrapes_shows_in_events_with_reasons(
    server: ServerProcess, mixed_adapters: list[Path]
) -> None:
    """Three adapters, two slots: what a scraper alone would miss, the event stream keeps."""
    with httpx.Client(timeout=60) as http:
        for name, path in (("b", mixed_adapters[1]), ("c", mixed_adapters[2])):
            response = http.post(
                f"{server.url}/v1/load_lora_adapter",
                json={"lora_name": name, "lora_path": str(path)},
            )
            assert response.status_code == 200, response.text
    assert response.json()["data"][0]["tiers"] == ["cpu"], "both slots taken: c waits in the host"
    before = _lora_views(server.url)
    for view in before.values():
        c_lines = [line for line in view if 'adapter_name="c"' in line and "loaded{" in line]
        assert c_lines and all('level="cpu"' in line for line in c_lines)
    readers = open_event_streams(server.url, SERVERS, params={"type": LIFECYCLE})
    try:
        # Slots: static (least recently used), b. c takes static's slot; static then takes b's.
        for model in ("b", "c", "static"):
            assert _complete(server.url, model).status_code == 200
        streams = {i: [_event(d) for _, d in r.wait_for(8)] for i, r in readers.items()}
        ids = {i: [event_id for event_id, _ in r.events] for i, r in readers.items()}
    finally:
        for reader in readers.values():
            reader.close()
    assert len({tuple(s) for s in streams.values()}) == 1, "every server: same events, same order"
    assert len({tuple(i) for i in ids.values()}) == 1, "... and the same ids"
    for rank in (0, 1):
        assert [e[1:] for e in streams["0"] if e[0] == rank] == [
            ("evicted", "static", "device:lru"),
            ("activated", "c", "device"),
            ("evicted", "b", "device:lru"),
            ("activated", "static", "device"),
        ]
    deadline = time.monotonic() + 30
    while True:
        after = _lora_views(server.url)
        if len({tuple(v) for v in after.values()}) == 1:
            break
        assert time.monotonic() < deadline, f"servers disagree: {after}"
        time.sleep(0.1)
    view = after["0"]
    for name in ("static", "b"):
        counter = f'{{adapter_name="{name}",event="evicted",reason="lru"}} 2.0'
        assert f"rankcast:lora_adapter_events_total{counter}" in view
    assert any('"cpu_to_gpu"' in line for line in view if "load_seconds_count" in line)
    resident = {
        (line.split('adapter_name="')[1].split('"')[0], line.split('level="')[1].split('"')[0])
        for line in view
        if line.startswith("vllm:lora_adapter_loaded{")
    }
    assert resident == {
        ("static", "gpu"),
        ("static", "cpu"),
        ("c", "gpu"),
        ("c", "cpu"),
        ("b", "cpu"),
    }


def test_eviction_skips_a_pinned_adapter_and_every_server_labels_it(
    server: ServerProcess,
) -> None:
    """Slots: static, c. Pinned, static stays even as the least recently used of the two."""
    with httpx.Client(timeout=60) as http:
        pinned = http.post(f"{server.url}/v1/pin_lora_adapter", json={"lora_name": "static"})
        assert pinned.status_code == 200 and pinned.json()["data"][0]["pinned"] is True
        missing = http.post(f"{server.url}/v1/pin_lora_adapter", json={"lora_name": "nope"})
        assert missing.status_code == 404
    deadline = time.monotonic() + 30
    while True:
        loaded = {
            i: [line for line in v if line.startswith("vllm:lora_adapter_loaded{")]
            for i, v in _lora_views(server.url).items()
        }
        static = [line for line in loaded["0"] if 'adapter_name="static"' in line]
        if len({tuple(v) for v in loaded.values()}) == 1 and all(
            'pinned="true"' in line for line in static
        ):
            break
        assert time.monotonic() < deadline, f"pin not seen everywhere: {loaded}"
        time.sleep(0.1)
    assert len(static) == 4  # gpu and cpu, ranks 0 and 1
    readers = open_event_streams(server.url, SERVERS, params={"type": LIFECYCLE})
    try:
        for model in ("c", "b"):  # c used last: static is the LRU one, yet c is evicted
            assert _complete(server.url, model).status_code == 200
        with httpx.Client(timeout=60) as http:
            unpinned = http.post(
                f"{server.url}/v1/unpin_lora_adapter", json={"lora_name": "static"}
            )
        assert unpinned.status_code == 200 and unpinned.json()["data"][0]["pinned"] is False
        for reader in readers.values():
            events = [_event(d) for _, d in reader.wait_for(6)]
            assert [e[1:] for e in events if e[0] == 1] == [
                ("evicted", "c", "device:lru"),
                ("activated", "b", "device"),
                ("unpinned", "static", "device"),
            ]
    finally:
        for reader in readers.values():
            reader.close()
    listing = {a["name"]: a for a in httpx.get(f"{server.url}/v1/lora_adapters").json()["data"]}
    assert listing["static"]["pinned"] is False and listing["c"]["tiers"] == ["cpu"]
    assert listing["b"]["tiers"] == ["device", "cpu"]
    # Both slots pinned: a request for a third adapter could never run, so it is refused.
    with httpx.Client(timeout=60) as http:
        for name in ("static", "b"):
            pin = http.post(f"{server.url}/v1/pin_lora_adapter", json={"lora_name": name})
            assert pin.status_code == 200
        deadline = time.monotonic() + 30
        while not all(  # the next request may reach the other server: wait until it knows
            {a["name"]: a["pinned"] for a in r.json()["data"]}
            == {"static": True, "b": True, "c": False}
            for r in each_server(server.url, SERVERS, "/v1/lora_adapters").values()
        ):
            assert time.monotonic() < deadline, "the pins did not reach every API server"
            time.sleep(0.1)
        refused = _complete(server.url, "c")
        assert refused.status_code == 400 and "pinned" in refused.json()["error"]["message"]
        for name in ("static", "b"):
            http.post(f"{server.url}/v1/unpin_lora_adapter", json={"lora_name": name})
    assert _complete(server.url, "c").status_code == 200


def test_a_restarted_api_server_agrees_on_adapter_state(server: ServerProcess) -> None:
    """After evictions, pins and unpins, a fresh API server must rebuild the same residency,
    event counts and load histogram from the engine's snapshot."""
    server.kill_and_await_restart("api_server_1")
    deadline = time.monotonic() + 30
    while True:
        views = _lora_views(server.url)
        listings = {
            i: r.json()["data"]
            for i, r in each_server(server.url, SERVERS, "/v1/lora_adapters").items()
        }
        if len({tuple(v) for v in views.values()}) == 1 and listings["0"] == listings["1"]:
            break
        assert time.monotonic() < deadline, f"servers disagree: {views} {listings}"
        time.sleep(0.2)
    assert {a["name"] for a in listings["1"]} == {"static", "b", "c"}
    assert any('event="pinned"' in line for line in views["1"]), "history came from the snapshot"


def test_an_adapter_whose_files_vanished_fails_its_request_with_a_400_naming_the_file(
    server: ServerProcess, mixed_adapters: list[Path]
) -> None:
    """Last in this module: it unloads the others to set up the host tier exactly."""
    doomed = mixed_adapters[0].parent / "doomed"
    shutil.copytree(mixed_adapters[0], doomed)
    with httpx.Client(timeout=60) as http:

        def call(path: str, **body: str) -> None:
            response = http.post(f"{server.url}/v1/{path}", json=body)
            assert response.status_code == 200, response.text

        for name in ("static", "b", "c"):
            call("unload_lora_adapter", lora_name=name)
        call("load_lora_adapter", lora_name="doomed", lora_path=str(doomed))  # slot 0
        call("load_lora_adapter", lora_name="f1", lora_path=str(mixed_adapters[1]))  # slot 1
        call("load_lora_adapter", lora_name="f2", lora_path=str(mixed_adapters[2]))  # host only
        assert _complete(server.url, "f2").status_code == 200  # evicts doomed (LRU) from its slot
        # The host tier (3) is full: f3 pushes out its only adapter off the device, doomed.
        call("load_lora_adapter", lora_name="f3", lora_path=str(mixed_adapters[0]))
        listing = {a["name"]: a for a in http.get(f"{server.url}/v1/lora_adapters").json()["data"]}
        assert listing["doomed"]["tiers"] == []
    (doomed / "adapter_model.safetensors").unlink()
    failed = _complete(server.url, "doomed")
    assert failed.status_code == 400
    assert "adapter_model.safetensors" in failed.json()["error"]["message"]
    assert _complete(server.url, "f1").status_code == 200, "the engine serves on"
    deadline = time.monotonic() + 30
    while True:  # the engine dropped it: every API server stops offering it
        offered = [
            {m["id"] for m in r.json()["data"]}
            for r in each_server(server.url, SERVERS, "/v1/models").values()
        ]
        if all("doomed" not in ids and "f1" in ids for ids in offered):
            break
        assert time.monotonic() < deadline, f"doomed still offered: {offered}"
        time.sleep(0.1)
    assert _complete(server.url, "doomed").status_code == 404
