"""One engine view on both kinds of API server: a Python and a Rust API server in front of one
engine serving two adapters with one device slot answer `/v1/engine_views` and
`/v1/lora_adapters` alike, at start and after an adapter is pinned, and both refuse a request on
the other adapter with the same 400 while the pinned one holds the only slot (both read the
refusal from their views, before the engine is asked).

The tests run in file order on one fleet, as an operator's session would.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.entrypoints.server_process import ServerProcess, tiny_model_args
from tests.frontend_rust.rust_fleet import frontend_env
from tests.lora.conftest import make_adapter

pytestmark = pytest.mark.scenario

SERVERS = {"0", "1"}  # the Python server, then the Rust one
BODY = {"prompt": [5, 17, 300, 42, 9], "max_tokens": 2, "ignore_eos": True}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Iterator[str]:
    root = tmp_path_factory.mktemp("view-adapters")
    for name, rank in (("a", 4), ("b", 8)):
        make_adapter(tiny_llama_dir, root / name, rank=rank, alpha=2 * rank)
    server = ServerProcess(
        *tiny_model_args(
            tiny_llama_dir,
            "--enable-lora", "--max-loras", "1", "--max-cpu-loras", "2",
            "--max-lora-rank", "8", "--lora-modules", f"a={root / 'a'}", f"b={root / 'b'}",
            "--allow-runtime-lora-updating",
        ),
        api_server_count=1,
        rust_api_server_count=1,
        env=frontend_env(),
    )  # fmt: skip
    with server.running():
        yield server.url


def _by_server(url: str, method: str, route: str, body: Any = None) -> dict[str, httpx.Response]:
    """The same request on fresh connections until both servers answered it."""
    answers: dict[str, httpx.Response] = {}
    deadline = time.monotonic() + 30
    while set(answers) != SERVERS:
        assert time.monotonic() < deadline, f"{route} answered only by {sorted(answers)}"
        response = httpx.request(method, f"{url}{route}", json=body, timeout=60)
        answers[response.headers["x-rankcast-api-server"]] = response
    return answers


def _agreed(url: str, route: str, timeout_s: float = 30) -> Any:
    """`route`'s JSON once both servers answer it alike (they follow one broadcast, not in the
    same microsecond)."""
    deadline = time.monotonic() + timeout_s
    while True:
        bodies = {}
        for server, response in _by_server(url, "GET", route).items():
            assert response.status_code == 200, (server, response.text)
            bodies[server] = response.json()
        if bodies["0"] == bodies["1"]:
            return bodies["1"]
        assert time.monotonic() < deadline, f"{route} differs:\n{bodies}"
        time.sleep(0.2)


def _adapter(view: dict[str, Any], name: str) -> dict[str, Any]:
    return next(a for a in view["lora"]["adapters"] if a["name"] == name)


def test_both_servers_show_the_same_views_at_start(fleet: str) -> None:
    views = _agreed(fleet, "/v1/engine_views")
    assert views["object"] == "list"
    (view,) = views["data"]
    assert (view["engine"], view["lora"]["max_loras"]) == (0, 1)
    assert [a["name"] for a in view["lora"]["adapters"]] == ["a", "b"]
    assert _adapter(view, "a")["tier"] in ("device", "cpu")
    adapters = _agreed(fleet, "/v1/lora_adapters")["data"]
    assert [a["name"] for a in adapters] == ["a", "b"]


def test_a_pinned_slot_refuses_the_other_adapter_on_both_servers(fleet: str) -> None:
    for _ in range(50):  # the Rust server does not serve runtime updates: a 404 there
        response = httpx.post(f"{fleet}/v1/pin_lora_adapter", json={"lora_name": "a"}, timeout=60)
        if response.headers["x-rankcast-api-server"] == "0":
            break
    assert response.status_code == 200, response.text
    deadline = time.monotonic() + 30
    while True:
        (view,) = _agreed(fleet, "/v1/engine_views")["data"]
        a = _adapter(view, "a")
        if a["tier"] == "device" and all(rank["pinned"] for rank in a["ranks"]):
            break
        assert time.monotonic() < deadline, f"a is not pinned in the views: {a}"
        time.sleep(0.2)
    described = {d["name"]: d for d in _agreed(fleet, "/v1/lora_adapters")["data"]}
    assert described["a"]["pinned"] and not described["b"]["pinned"]

    refused = _by_server(fleet, "POST", "/v1/completions", {**BODY, "model": "b"})
    errors = {server: (r.status_code, r.json()["error"]) for server, r in refused.items()}
    assert errors["1"] == errors["0"], errors
    status, error = errors["1"]
    assert status == 400 and error["param"] == "model", errors
    assert "holds a pinned adapter (a)" in error["message"], error

    served = _by_server(fleet, "POST", "/v1/completions", {**BODY, "model": "a"})
    assert all(r.status_code == 200 for r in served.values()), {
        s: r.text for s, r in served.items()
    }
