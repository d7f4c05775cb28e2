"""A rank that fails while its notifications are gathered: the engine core stops (after its ranks)
and every API server answers 503, with no hang; then the launcher starts the engine core again
and the servers serve. A module of its own: it ends its server's first engine."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rankcast.process import process_is_alive
from tests.entrypoints.notification_clients import producer_server_args, worker_rpc
from tests.entrypoints.server_process import ServerProcess
from tests.reliability.fleet import until_every_server

SERVERS = 2


@pytest.fixture()
def server(tiny_llama_dir: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        *producer_server_args(tiny_llama_dir, "--tensor-parallel-size", "2"),
        api_server_count=SERVERS,
    )
    with proc.running():
        yield proc


def test_a_rank_failing_under_a_gather_stops_the_engine_and_servers_answer_503(
    server: ServerProcess,
) -> None:
    """It ends the engine core on purpose, so it has a server of its own."""
    first = server.pid_of("engine_core_dp0")
    response = worker_rpc(server.url, "break_notification_drain", 1)
    assert response.status_code in (400, 503)  # the call's own gather is the one that fails
    until_every_server(server.url, SERVERS, 503, 60)
    # The engine core exits (after stopping its ranks), not just its sockets.
    deadline = time.monotonic() + 60
    while process_is_alive(first):
        assert time.monotonic() < deadline, "the engine core process did not exit"
        time.sleep(0.2)
    # Then its next incarnation serves every API server again.
    until_every_server(server.url, SERVERS, 200, 60)
    assert server.pid_of("engine_core_dp0") != first
