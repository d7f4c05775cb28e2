"""LoRA on the real model at tensor-parallel size 3 (SmolLM2's 9 heads and 3 KV heads split
three ways), two API servers, one device slot for two adapters.

Real PEFT adapters made here with `peft` on SmolLM2; greedy output must match transformers +
peft; every server must show every rank's residency; and under load the router view must show
which adapter runs and which waits for the slot.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import reference_greedy
from tests.entrypoints.notification_clients import scrape_each
from tests.entrypoints.server_process import ServerProcess
from tests.lora.conftest import make_adapter
from tests.lora.router_view import each_server, requests_info

SERVERS = 2
TOKENS = 8


@pytest.fixture(scope="module")
def smol_adapters(
    embedded_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("smol-adapters")
    paths = {"x": root / "x", "y": root / "y"}
    for rank, path in zip((8, 4), paths.values(), strict=True):
        make_adapter(embedded_model_dir, path, rank=rank, alpha=rank)
    return paths


@pytest.fixture(scope="module")
def server(smol_adapters: dict[str, Path]) -> Iterator[ServerProcess]:
    proc = ServerProcess(  # no MODEL: the embedded SmolLM2
        "--dtype",
        "float32",
        "--kv-cache-space",
        "0.1",
        "--tensor-parallel-size",
        "3",
        "--enable-lora",
        "--max-loras",
        "1",
        "--max-cpu-loras",
        "2",
        "--max-lora-rank",
        "8",
        # No turns: a request for another adapter waits until the running one is done, which
        # is what the routers' view test watches (with turns it takes the slot at once).
        "--lora-turn-steps",
        "0",
        "--lora-modules",
        *(f"{name}={path}" for name, path in smol_adapters.items()),
        api_server_count=SERVERS,
    )
    with proc.running():
        yield proc


def _prompt(model_dir: Path) -> list[int]:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    return tokenizer("The three primary colors are", add_special_tokens=False).input_ids


def test_every_server_shows_both_adapters_on_all_three_ranks(server: ServerProcess) -> None:
    """Whichever adapter holds the one slot now (other tests use both), every rank agrees and
    every server says so."""
    views = []
    for response in each_server(server.url, SERVERS, "/v1/lora_adapters").values():
        tiers = {
            a["name"]: [(r["rank"], r["tiers"]) for r in a["engines"][0]["ranks"]]
            for a in response.json()["data"]
        }
        on_device = [name for name, ranks in tiers.items() if ranks[0][1] == ["device", "cpu"]]
        assert len(on_device) == 1 and sorted(tiers) == ["x", "y"]
        (slot_holder,) = on_device
        other = "y" if slot_holder == "x" else "x"
        assert tiers == {
            slot_holder: [(rank, ["device", "cpu"]) for rank in range(3)],
            other: [(rank, ["cpu"]) for rank in range(3)],
        }
        views.append(tiers)
    assert all(view == views[0] for view in views)


def test_greedy_output_with_an_adapter_equals_transformers_and_peft(
    server: ServerProcess, embedded_model_dir: Path, smol_adapters: dict[str, Path]
) -> None:
    import transformers

    prompt = _prompt(embedded_model_dir)
    reference = reference_greedy(embedded_model_dir, prompt, TOKENS, smol_adapters["y"])
    body = {"prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=120) as http:
        got = http.post(f"{server.url}/v1/completions", json={**body, "model": "y", "logprobs": 1})
    assert got.status_code == 200, got.text
    # y had no slot: serving it moved it to the device on all three ranks, evicting x.
    generated = got.json()["choices"][0]["logprobs"]["tokens"]
    assert len(generated) == TOKENS
    want = transformers.AutoTokenizer.from_pretrained(str(embedded_model_dir)).decode(reference)
    assert got.json()["choices"][0]["text"] == want


def test_under_load_routers_read_which_adapter_runs_and_which_waits(
    server: ServerProcess, embedded_model_dir: Path
) -> None:
    """One slot: while a request on y runs, a request on x waits for it; both show, the same,
    on every API server, and x runs as soon as y's request is gone."""
    prompt = _prompt(embedded_model_dir)
    body = {"model": "y", "prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}
    client = httpx.Client(timeout=120)
    stream = client.send(
        client.build_request("POST", f"{server.url}/v1/completions", json=body), stream=True
    )
    short = {"model": "x", "prompt": prompt, "max_tokens": 2}
    replies: list[httpx.Response] = []
    waiter = threading.Thread(
        target=lambda: replies.append(
            httpx.post(f"{server.url}/v1/completions", json=short, timeout=300)
        )
    )
    try:
        assert stream.status_code == 200, stream.read()
        # Keep the line iterator alive: a dropped one closes the stream, and so aborts y.
        lines = stream.iter_lines()
        next(lines)  # y is running
        waiter.start()
        deadline = time.monotonic() + 60
        while True:
            views = {i: requests_info(t) for i, t in scrape_each(server.url, SERVERS).items()}
            if all(v == {"running": ["y"], "waiting": ["x"]} for v in views.values()):
                break
            assert time.monotonic() < deadline, f"router views: {views}"
            time.sleep(0.05)
        listing = {a["name"]: a for a in httpx.get(f"{server.url}/v1/lora_adapters").json()["data"]}
        assert listing["y"]["running_requests"] == 1 and listing["x"]["waiting_requests"] == 1
        assert listing["x"]["tiers"] == ["cpu"], "x must not take the slot while y runs"
    finally:
        stream.close()  # the client leaves: y's request is aborted and the slot frees
        client.close()
        if waiter.ident is not None:
            waiter.join()
    assert replies and replies[0].status_code == 200, replies
    listing = {a["name"]: a for a in httpx.get(f"{server.url}/v1/lora_adapters").json()["data"]}
    assert listing["x"]["tiers"] == ["device", "cpu"] and listing["y"]["tiers"] == ["cpu"]
