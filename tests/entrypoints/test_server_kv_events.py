"""KV-cache events across processes: both API servers' `/v1/events` streams rebuild the engine's
prefix-cache index exactly, through evictions, and agree with the engine's catch-up snapshot."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from rankcast.channel.events import AnyNotification
from rankcast.channel.kv_index import KVCacheIndex
from tests.engine.test_kv_events import random_workload
from tests.entrypoints.notification_clients import engine_snapshot, open_event_streams
from tests.entrypoints.server_process import ServerProcess, free_port

KV_TYPES = "kv_blocks_stored,kv_blocks_removed,kv_cache_cleared"


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[ServerProcess]:
    replay = free_port()
    proc = ServerProcess(
        str(tiny_llama_dir),
        "--dtype",
        "float32",
        "--num-gpu-blocks-override",
        "40",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "64",
        "--kv-events",
        "--notification-events-endpoint",
        f"tcp://127.0.0.1:{free_port()}",
        "--notification-events-replay-endpoint",
        f"tcp://127.0.0.1:{replay}",
        api_server_count=2,
    )
    proc.replay_endpoint = f"tcp://127.0.0.1:{replay}"  # type: ignore[attr-defined]
    with proc.running():
        yield proc


def test_both_api_servers_rebuild_the_engines_index(server: ServerProcess) -> None:
    readers = open_event_streams(server.url, 2, params={"type": KV_TYPES})
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            for prompt in random_workload(seed=3, count=24):
                body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
                assert http.post("/v1/completions", json=body).status_code == 200
        # Quiet now: the engine's snapshot includes every event it sent.
        deadline = time.monotonic() + 30
        while True:
            snapshot = engine_snapshot(server.replay_endpoint)  # type: ignore[attr-defined]
            assert snapshot.kv_cache is not None
            want = KVCacheIndex.from_state(snapshot.kv_cache)
            got = {}
            for name, reader in readers.items():
                index = KVCacheIndex()
                for _, data in list(reader.events):
                    index.apply(msgspec.convert(data, AnyNotification))
                got[name] = index.blocks
            if got["0"] == want.blocks and got["1"] == want.blocks:
                break
            assert time.monotonic() < deadline, "the streams never matched the engine's index"
            time.sleep(0.2)
        types = {data["type"] for _, data in readers["0"].events}
        assert {"kv_blocks_stored", "kv_blocks_removed"} <= types, "stored and evicted"
        assert all(data.get("rank", -1) == -1 for _, data in readers["0"].events), "engine_core"
    finally:
        for reader in readers.values():
            reader.close()
