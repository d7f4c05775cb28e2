"""Test clients of the notification channel's HTTP side: one SSE reader per API server, per-server
scrapes, and the worker-extension RPC. API servers share one port, so reaching a given one means
opening connections until the kernel hands one to it."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import zmq

from rankcast.channel.snapshot import EngineStateSnapshot
from rankcast.channel.stream import SNAPSHOT_REQUEST

PRODUCER = "tests.worker.producers:EventProducer"


def producer_server_args(model: Path, *layout: str) -> list[str]:
    """`rankcast serve` arguments for the tiny model with the test producer in every rank."""
    return [
        str(model),
        "--dtype",
        "float32",
        "--kv-cache-space",
        "0.05",
        "--worker-extension-cls",
        PRODUCER,
        *layout,
    ]


@dataclass
class SSEReader:
    """Reads one `/v1/events` stream on a thread; `events` fills as they arrive."""

    response: httpx.Response
    client: httpx.Client
    server: str
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    controls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        event_id, name = "", ""
        try:
            for line in self.response.iter_lines():
                if line.startswith("id: "):
                    event_id = line[4:]
                elif line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    data = json.loads(line[6:])
                    if name:
                        self.controls.append((name, data))
                    else:
                        self.events.append((event_id, data))
                    event_id, name = "", ""
        except httpx.HTTPError:
            return

    def wait_for(self, count: int, timeout_s: float = 30) -> list[tuple[str, dict[str, Any]]]:
        deadline = time.monotonic() + timeout_s
        while len(self.events) < count:
            assert time.monotonic() < deadline, (
                f"API server {self.server}: {len(self.events)} of {count} events arrived"
            )
            time.sleep(0.02)
        return list(self.events)

    def close(self) -> None:
        self.response.close()
        self.client.close()


def open_event_streams(
    url: str,
    count: int,
    params: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
) -> dict[str, SSEReader]:
    """One open `/v1/events` stream per API server, keyed by server index."""
    readers: dict[str, SSEReader] = {}
    deadline = time.monotonic() + 30
    while len(readers) < count:
        assert time.monotonic() < deadline, f"reached only API servers {sorted(readers)}"
        client = httpx.Client(timeout=httpx.Timeout(10, read=None))
        request = client.build_request("GET", f"{url}/v1/events", params=params, headers=headers)
        response = client.send(request, stream=True)
        assert response.status_code == 200, response.read()
        server = response.headers["x-rankcast-api-server"]
        if server in readers:
            response.close()
            client.close()
            continue
        readers[server] = SSEReader(response, client, server)
    return readers


def scrape_each(url: str, count: int) -> dict[str, str]:
    """`/metrics` of every API server, keyed by server index."""
    samples: dict[str, str] = {}
    deadline = time.monotonic() + 30
    while len(samples) < count:
        assert time.monotonic() < deadline, f"scraped only API servers {sorted(samples)}"
        with httpx.Client(timeout=10) as http:
            response = http.get(f"{url}/metrics")
        assert response.status_code == 200, response.text
        samples[response.headers["x-rankcast-api-server"]] = response.text
    return samples


def families(text: str) -> dict[str, list[str]]:
    """Exposition lines by family (HELP, TYPE and samples), keyed by the family's name."""
    by_family: dict[str, list[str]] = {}
    current = ""
    for line in text.splitlines():
        if line.startswith("# HELP "):
            current = line.split()[2]
        by_family.setdefault(current, []).append(line)
    return by_family


def series(text: str, *prefixes: str) -> list[str]:
    """The exposition lines of the named metrics, sorted (creation timestamps left out)."""
    return sorted(
        line
        for line in text.splitlines()
        if line.startswith(prefixes) and "_created" not in line.split(" ")[0]
    )


def worker_rpc(url: str, method: str, *args: Any) -> httpx.Response:
    with httpx.Client(timeout=60) as http:
        return http.post(f"{url}/collective_rpc", json={"method": method, "args": list(args)})


def prefix_cache_totals(text: str) -> tuple[float, float]:
    """(queries, hits) of one engine's prefix-cache counters in a `/metrics` exposition."""
    values = {}
    for line in text.splitlines():
        for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
            if line.startswith(name + "{"):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values["vllm:prefix_cache_queries_total"], values["vllm:prefix_cache_hits_total"]


def engine_snapshot(endpoint: str) -> EngineStateSnapshot:
    """The engine's state snapshot, asked of its notification replay socket as a late
    subscriber asks it."""
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", SNAPSHOT_REQUEST])
        assert dealer.poll(10_000), "the notification replay socket did not answer"
        _, _, _, state = dealer.recv_multipart()
        return msgspec.msgpack.decode(state, type=EngineStateSnapshot)
    finally:
        dealer.close(0)
        context.term()
