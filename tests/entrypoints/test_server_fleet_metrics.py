"""Counters read the same whichever API server a scrape lands on.

Three API servers share the port. Under load, consecutive scrapes (fresh connections, so the
kernel picks the server) never see a counter or histogram series go back; at rest every server
reports the same value for each, and the fleet's totals are exactly what the clients were
served; a killed and restarted API server takes nothing away from them.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.server_process import ServerProcess, tiny_model_args
from tests.lora.router_view import each_server

SERVERS = 3
COUNTER_SUFFIXES = ("_total", "_count", "_sum", "_bucket")


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        *tiny_model_args(tiny_llama_dir, "--max-model-len", "128"), api_server_count=SERVERS
    )
    with proc.running():
        yield proc


def counters(text: str) -> dict[str, float]:
    """Every counter and histogram sample of one exposition, by series."""
    found = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        series, value = line.rsplit(" ", 1)
        name = series.split("{", 1)[0]
        if name.endswith(COUNTER_SUFFIXES):
            found[series] = float(value)
    return found


class Load:
    """Clients sending completions until stopped; counts what they were served."""

    def __init__(self, url: str, clients: int) -> None:
        self.url = url
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.requests = 0
        self.tokens = 0
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]
        for thread in self.threads:
            thread.start()

    def _run(self) -> None:
        body = {"prompt": "Count with me:", "max_tokens": 12, "ignore_eos": True}
        while not self.stop.is_set():
            with httpx.Client(timeout=60) as http:
                response = http.post(f"{self.url}/v1/completions", json=body)
            assert response.status_code == 200, response.text
            with self.lock:
                self.requests += 1
                self.tokens += response.json()["usage"]["completion_tokens"]

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)


def _at_rest(url: str, timeout_s: float = 30.0) -> dict[str, dict[str, float]]:
    """Each server's counters, once all of them agree (they follow the same broadcast, so
    they do within moments of the last request); fails if they never do."""
    deadline = time.monotonic() + timeout_s
    while True:
        views = {k: counters(r.text) for k, r in each_server(url, SERVERS, "/metrics").items()}
        first = next(iter(views.values()))
        if all(view == first for view in views.values()):
            return views
        assert time.monotonic() < deadline, "the API servers never agreed at rest"
        time.sleep(0.2)


def _total(view: dict[str, float], name: str) -> float:
    return sum(v for series, v in view.items() if series.split("{", 1)[0] == name)


def test_counters_never_go_back_between_servers_and_agree_at_rest(server: ServerProcess) -> None:
    start = next(iter(_at_rest(server.url).values()))  # the module's other test may have run
    load = Load(server.url, clients=4)
    scrapes: list[tuple[str, dict[str, float]]] = []
    try:
        for _ in range(30):
            with httpx.Client(timeout=30) as http:  # a new connection: any server may answer
                response = http.get(f"{server.url}/metrics")
            scrapes.append((response.headers["x-rankcast-api-server"], counters(response.text)))
            time.sleep(0.05)
    finally:
        load.finish()
    assert len({answered for answered, _ in scrapes}) >= 2, "every scrape hit one server"
    for (was, before), (now, after) in itertools.pairwise(scrapes):
        for series, value in before.items():
            if series in after:
                assert after[series] >= value, (
                    f"{series} went back: {value} -> {after[series]} (server {was} then {now})"
                )
    view = next(iter(_at_rest(server.url).values()))

    def served(name: str) -> float:
        return _total(view, name) - _total(start, name)

    # The fleet's totals are what the clients were served, not one server's share.
    assert served("vllm:request_success_total") == load.requests
    assert served("vllm:generation_tokens_total") == load.tokens
    assert served("vllm:e2e_request_latency_seconds_count") == load.requests
    # Every token after a request's first is one inter-token latency (gathered per engine step
    # and written when the step's outputs are done: none may be left unwritten).
    assert served("vllm:time_to_first_token_seconds_count") == load.requests
    assert served("vllm:inter_token_latency_seconds_count") == load.tokens - load.requests


def test_a_restarted_api_server_takes_nothing_from_the_totals(server: ServerProcess) -> None:
    body = {"prompt": "Count with me:", "max_tokens": 5, "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        for _ in range(6):  # new connections each time would be nicer; any server will do
            assert http.post(f"{server.url}/v1/completions", json=body).status_code == 200
    before = next(iter(_at_rest(server.url).values()))
    server.kill_and_await_restart("api_server_1")
    after = next(iter(_at_rest(server.url).values()))
    for series, value in before.items():
        if series.split("{", 1)[0].startswith(("vllm:", "rankcast:engine_notifications")):
            assert after.get(series, 0.0) >= value, f"{series}: {value} -> {after.get(series)}"
    assert _total(after, "vllm:request_success_total") == _total(
        before, "vllm:request_success_total"
    )
