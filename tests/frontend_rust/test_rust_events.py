"""`/v1/events` on the Rust API server: the same events, with the same ids, in the same order as
on its Python siblings (events published in two tensor-parallel ranks), resumable with
`Last-Event-ID` on either kind of server, and a malformed id refused with a 400."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.notification_clients import open_event_streams, producer_server_args
from tests.entrypoints.server_process import ServerProcess
from tests.frontend_rust.rust_fleet import frontend_env
from tests.worker.producers import KEY

SERVERS = {"0", "1", "2"}  # two Python servers, then the Rust one
RUST = "2"


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(
        *producer_server_args(tiny_llama_dir, "--tensor-parallel-size", "2"),
        api_server_count=2,
        rust_api_server_count=1,
        env=frontend_env(),
    )
    with server.running():
        yield server


def _publish(url: str, count: int, key: str) -> None:
    """Ask every rank to publish `count` events (through a Python server: the Rust one does
    not serve /collective_rpc)."""
    for _ in range(50):
        with httpx.Client(timeout=60) as http:
            response = http.post(
                f"{url}/collective_rpc", json={"method": "publish_events", "args": [count, key]}
            )
        if response.headers["x-rankcast-api-server"] != RUST:
            assert response.status_code == 200, response.text
            return
    raise AssertionError("no Python server took the call")


def test_every_server_streams_the_same_events_with_the_same_ids(fleet: ServerProcess) -> None:
    readers = open_event_streams(fleet.url, len(SERVERS), params={"key": KEY})
    try:
        assert set(readers) == SERVERS
        _publish(fleet.url, 4, KEY)
        streams = {server: reader.wait_for(8) for server, reader in readers.items()}
        python = streams["0"]
        assert sorted((d["rank"], d["payload"]["i"]) for _, d in python) == [
            (r, i) for r in (0, 1) for i in range(4)
        ]
        assert streams[RUST] == python, "the Rust server: same events, same ids, same order"
        assert streams["1"] == python
    finally:
        for reader in readers.values():
            reader.close()


def test_a_stream_resumes_from_an_id_on_either_kind_of_server(fleet: ServerProcess) -> None:
    key = "test.rust.resume"
    readers = open_event_streams(fleet.url, 1, params={"key": key})
    (reader,) = readers.values()
    try:
        _publish(fleet.url, 3, key)
        seen = reader.wait_for(6)
    finally:
        reader.close()
    resumed = open_event_streams(
        fleet.url, len(SERVERS), params={"key": key}, headers={"Last-Event-ID": seen[1][0]}
    )
    try:
        for server, again in resumed.items():
            assert again.wait_for(4) == seen[2:], f"server {server}"
            assert again.controls == []
    finally:
        for again in resumed.values():
            again.close()


def test_a_malformed_last_event_id_is_a_400_on_the_rust_server(fleet: ServerProcess) -> None:
    for _ in range(50):
        with httpx.Client(timeout=10) as http:
            response = http.get(f"{fleet.url}/v1/events", headers={"Last-Event-ID": "nonsense"})
        if response.headers["x-rankcast-api-server"] == RUST:
            assert response.status_code == 400
            assert "Last-Event-ID" in response.json()["error"]["message"]
            return
    raise AssertionError("no request reached the Rust server")
