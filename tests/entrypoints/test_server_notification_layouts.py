"""Every rank of every layout reaches every API server: PP=2 (stage 0 never answers a step) x
DP=2 (two engine cores), three API servers, with a producer installed as a worker plugin."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.entrypoints.notification_clients import (
    open_event_streams,
    producer_server_args,
    scrape_each,
    series,
    worker_rpc,
)
from tests.entrypoints.server_process import ServerProcess
from tests.worker.producers import KEY

SERVERS = 3
REPO = Path(__file__).resolve().parents[2]


def _install_plugin(root: Path) -> Path:
    """An installed distribution, as pip would leave it, declaring one worker plugin."""
    info = root / "rankcast_test_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: rankcast-test-plugin\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text(
        "[rankcast.worker_plugins]\nannounce = tests.worker.producers:announce_plugin\n"
    )
    return root


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    site = _install_plugin(tmp_path_factory.mktemp("site"))
    path = os.pathsep.join(p for p in (str(site), str(REPO), os.environ.get("PYTHONPATH")) if p)
    proc = ServerProcess(
        *producer_server_args(
            tiny_llama_dir, "--pipeline-parallel-size", "2", "--data-parallel-size", "2"
        ),
        api_server_count=SERVERS,
        env={"PYTHONPATH": path},
    )
    try:
        proc.wait_healthy(timeout_s=300)
        yield proc
    finally:
        assert proc.stop() == []


def test_load_time_events_of_every_rank_and_engine_reach_every_server(
    server: ServerProcess,
) -> None:
    views = {
        i: series(text, "rankcast:worker_weights_load_seconds{", "rankcast:engine_notifications")
        for i, text in scrape_each(server.url, SERVERS).items()
    }
    first = views["0"]
    loads = [line.split(" ")[0] for line in first if line.startswith("rankcast:worker_weights")]
    assert loads == [
        f'rankcast:worker_weights_load_seconds{{engine="{e}",rank="{r}"}}'
        for e in (0, 1)
        for r in (0, 1)
    ]
    assert 'rankcast:engine_notifications_total{key="test.plugin",type="custom"} 4.0' in first
    assert all(view == first for view in views.values())


def test_events_from_every_rank_of_both_engines_arrive_everywhere_in_the_same_order(
    server: ServerProcess,
) -> None:
    readers = open_event_streams(server.url, SERVERS, params={"type": "custom", "key": KEY})
    try:
        response = worker_rpc(server.url, "publish_events", 2)
        assert response.json() == {"results": [[0, 1], [0, 1]]}
        streams = {i: r.wait_for(8) for i, r in readers.items()}
    finally:
        for reader in readers.values():
            reader.close()
    for engine in (0, 1):
        per_server = [
            [
                (eid, d["rank"], d["pp_rank"], d["payload"]["i"])
                for eid, d in s
                if d["engine_index"] == engine
            ]
            for s in streams.values()
        ]
        assert [(r, pp, i) for _, r, pp, i in per_server[0]] == [
            (0, 0, 0),
            (0, 0, 1),
            (1, 1, 0),
            (1, 1, 1),
        ]
        assert all(view == per_server[0] for view in per_server), "same order on every server"
