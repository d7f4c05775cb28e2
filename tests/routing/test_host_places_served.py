"""The host-tier size `rankcast serve --max-cpu-loras` reaches the router of every API server.

An engine whose host tier is taken by other adapters' requests in flight holds a request for
one more adapter until one of them has finished every request, so the router sends such a
request elsewhere, even to a busier engine. The router can do so only if it knows the tier's
size: tests/routing/test_engine_router.py holds the rule on a router built by hand; this test
holds the launcher to passing the size to each API server and each API server to its router,
with real processes: two engines (one slot and two host places each) behind two API servers.

Engine 0 runs requests for adapters a and c (its whole host tier), engine 1 five for b. A
request for p, which no engine holds, costs a disk read either way; by load it would go to
engine 0 (two requests against five). Knowing engine 0's tier is full, every API server sends it
to engine 1. `--routing-policy adapter` leaves out the prefix terms, whose blocks (stored as
the streams run) would otherwise move the costs too."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import write_tiny_model
from tests.entrypoints.server_process import ServerProcess, tiny_model_args
from tests.lora.conftest import make_adapter
from tests.lora.router_view import each_server
from tests.routing.kv_stream import wait_for

SERVERS = 2
CONTEXT = 4096  # long enough that the streams run for the whole test


@pytest.fixture(scope="module")
def server(
    tokenizer_source: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """Round robin, the first two of each share: engine 0 starts with a (slot) and c, engine 1
    with b (slot) and d; p is on disk only."""
    root = tmp_path_factory.mktemp("host-places")
    model = write_tiny_model(
        root / "model", tokenizer_from=tokenizer_source, max_position_embeddings=CONTEXT
    )
    make_adapter(model, root / "r4", rank=4, alpha=8)
    proc = ServerProcess(
        *tiny_model_args(model),
        f"--max-model-len={CONTEXT}",
        "--data-parallel-size=2",
        "--routing-policy=adapter",
        "--enable-lora",
        "--max-loras=1",
        "--max-cpu-loras=2",
        "--max-lora-rank=8",
        "--lora-modules",
        *(f"{name}={root / 'r4'}" for name in "abcdp"),
        api_server_count=SERVERS,
    )
    with proc.running():
        yield proc


def _start(
    http: httpx.Client, url: str, model: str, prompt: list[int], tokens: int
) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": tokens, "stream": True, "ignore_eos": True}
    request = http.build_request("POST", f"{url}/v1/completions", json={**body, "model": model})
    response = http.send(request, stream=True)
    assert response.status_code == 200, response.read()
    return response


def _in_flight(text: str, engine: int) -> float:
    """Running plus waiting requests of one engine, as its last stats said."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if re.match(rf'vllm:num_requests_(running|waiting)\{{.*engine="{engine}"', line)
    )


def test_every_api_server_avoids_an_engine_whose_host_tier_other_adapters_fill(
    server: ServerProcess,
) -> None:
    # Streams left open, not read, while the test runs; closing them ends their requests, so
    # the fleet stops without waiting for them.
    opened: list[httpx.Response] = []
    with httpx.Client(timeout=httpx.Timeout(60, read=None)) as http:
        try:
            _route_around_the_full_tier(server, http, opened)
        finally:
            for response in opened:
                response.close()


def _route_around_the_full_tier(
    server: ServerProcess, http: httpx.Client, opened: list[httpx.Response]
) -> None:
    def start(model: str, prompt: list[int]) -> str:
        opened.append(_start(http, server.url, model, prompt, CONTEXT - 16))
        return opened[-1].headers["x-rankcast-engine"]

    assert [start(name, [5, 6, 7]) for name in "ac"] == ["0", "0"], "where they are held"
    assert {start("b", [20 + i, 21, 22]) for i in range(5)} == {"1"}, "where b is held"
    wait_for(
        lambda: all(
            (_in_flight(r.text, 0), _in_flight(r.text, 1)) == (2, 5)
            for r in each_server(server.url, SERVERS, "/metrics").values()
        ),
        "both API servers to hear of the requests in flight",
    )
    chosen: dict[str, set[str]] = {}
    for _ in range(40):  # the same request until each API server has answered it
        response = _start(http, server.url, "p", [9, 10, 11], 1)
        response.close()
        chosen.setdefault(response.headers["x-rankcast-api-server"], set()).add(
            response.headers["x-rankcast-engine"]
        )
        if len(chosen) == SERVERS:
            break
    assert chosen == {str(i): {"1"} for i in range(SERVERS)}, (
        f"engine 0's host tier is full of a and c: {chosen}"
    )
