"""vLLM-format KV-cache events from real engine cores (`--kv-events-config`), checked as their
consumers read them: the frames and fields vLLM's publisher writes, a sequence from 0 per
engine process without gaps, `AllBlocksCleared` first in every incarnation and at once after
an idle reset, stored blocks whose parents were announced and whose tokens fill whole blocks,
each engine on its own port with its own DP rank, replay from a sequence, and an index rebuilt
from the stream equal to the engine's own. Then the same frames go through vLLM's own decoder
(`vllm.distributed.kv_events`, from the anchor's virtualenv) where one is installed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from tests.engine.test_kv_events import random_workload
from tests.entrypoints.notification_clients import engine_snapshot
from tests.entrypoints.server_process import ServerProcess, free_port
from tests.routing.kv_stream import (
    REQUIRED_FIELDS,
    Frame,
    free_port_pair,
    replay,
    subscribed,
    wait_for,
)

TOPIC = "kv@pod-a@tiny"
BLOCK_SIZE = 16


@dataclass
class Run:
    """What a router would have received from a two-engine server through a workload, an
    idle prefix-cache reset, a `kill -9` of engine 0's core and more requests."""

    frames: list[list[Frame]]  # per engine, in arrival order (replayed start merged in)
    restart_at: int  # index in engine 0's frames of the new incarnation's first frame
    replay_after: list[list[Frame]]  # per engine: a replay from 0 at the end
    indexes_matched: bool


def rebuild(frames: list[Frame]) -> dict[int, tuple[int | None, tuple[int, ...]]]:
    """A consumer's index of one engine: block hash -> (parent, tokens), applied in order."""
    index: dict[int, tuple[int | None, tuple[int, ...]]] = {}
    for frame in frames:
        for event in frame.batch()[1]:
            if event["type"] == "AllBlocksCleared":
                index.clear()
            elif event["type"] == "BlockRemoved":
                for name in event["block_hashes"]:
                    index.pop(name, None)
            else:
                size, tokens = event["block_size"], event["token_ids"]
                parent = event["parent_block_hash"]
                for i, name in enumerate(event["block_hashes"]):
                    index[name] = (parent, tuple(tokens[i * size : (i + 1) * size]))
                    parent = name
    return index


def _current_incarnation(frames: list[Frame]) -> list[Frame]:
    starts = [i for i, frame in enumerate(frames) if frame.seq == 0]
    return frames[starts[-1] :] if starts else frames


def _indexes_match(streams: list[Any], snapshots: list[str]) -> bool:
    for stream, endpoint in zip(streams, snapshots, strict=True):
        snapshot = engine_snapshot(endpoint)
        assert snapshot.kv_cache is not None
        want = {b.block_hash: (b.parent, tuple(b.token_ids)) for b in snapshot.kv_cache.blocks}
        if rebuild(_current_incarnation(stream.snapshot())) != want:
            return False
    return True


def _complete(url: str, prompts: list[list[int]]) -> None:
    with httpx.Client(base_url=url, timeout=120) as http:
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            assert http.post("/v1/completions", json=body).status_code == 200


@pytest.fixture(scope="module")
def run(tiny_llama_dir: Path) -> Iterator[Run]:
    pub, replay_base, notify, notify_replay = (free_port_pair() for _ in range(4))
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{pub}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_base}",
        "topic": TOPIC,
    }
    server = ServerProcess(
        str(tiny_llama_dir),
        "--dtype=float32",
        "--num-gpu-blocks-override=32",
        "--max-num-seqs=4",
        "--max-num-batched-tokens=64",
        "--data-parallel-size=2",
        f"--kv-events-config={json.dumps(config)}",
        # rankcast's own stream too, for the engine's snapshot of its index to compare with.
        "--kv-events",
        f"--notification-events-endpoint=tcp://127.0.0.1:{notify}",
        f"--notification-events-replay-endpoint=tcp://127.0.0.1:{notify_replay}",
        api_server_count=1,
    )
    endpoints = [f"tcp://127.0.0.1:{pub + i}" for i in range(2)]
    replays = [f"tcp://127.0.0.1:{replay_base + i}" for i in range(2)]
    snapshots = [f"tcp://127.0.0.1:{notify_replay + i}" for i in range(2)]
    with server.running(), subscribed(endpoints, TOPIC.encode()) as streams:
        # A subscriber that joins late catches up by replay from 0, then reads live: merged by
        # seq, as vLLM's consumers do.
        early = [replay(endpoint, 0) for endpoint in replays]
        _complete(server.url, random_workload(seed=5, count=24))
        wait_for(lambda: _indexes_match(streams, snapshots), "the streams to match the engines")

        # An idle reset: its AllBlocksCleared leaves at once, no request needed.
        counts = [len(stream.snapshot()) for stream in streams]
        assert httpx.post(f"{server.url}/reset_prefix_cache", timeout=30).status_code == 200
        wait_for(
            lambda: all(
                any(e["type"] == "AllBlocksCleared" for f in s.snapshot()[n:] for e in f.batch()[1])
                for s, n in zip(streams, counts, strict=True)
            ),
            "the reset's AllBlocksCleared on both engines while idle",
            timeout_s=10,
        )
        _complete(server.url, random_workload(seed=6, count=8))

        old = server.pid_of("engine_core_dp0")
        os.kill(old, signal.SIGKILL)

        def restarted() -> bool:
            try:
                health = httpx.get(f"{server.url}/health", timeout=2)
            except httpx.HTTPError:
                return False
            return health.status_code == 200 and all(e["up"] for e in health.json()["engines"])

        def replaced() -> bool:
            try:
                return server.pid_of("engine_core_dp0") != old
            except LookupError:
                return False

        wait_for(replaced, "a new engine core 0", 120)
        wait_for(restarted, "engine 0 back", 120)
        _complete(server.url, random_workload(seed=7, count=12))
        wait_for(lambda: _indexes_match(streams, snapshots), "the streams to match again")
        matched = _indexes_match(streams, snapshots)
        frames = []
        for early_frames, stream in zip(early, streams, strict=True):
            live = stream.snapshot()
            first_live = live[0].seq if live else 0
            frames.append([f for f in early_frames if f.seq < first_live] + live)
        # Where engine 0's sequence first breaks: the new incarnation's first frame. (Counting
        # the frames heard before the kill raced the old incarnation's last frames in transit.)
        seqs = [f.seq for f in frames[0]]
        restart_at = next((i for i in range(1, len(seqs)) if seqs[i] != seqs[i - 1] + 1), len(seqs))
        yield Run(frames, restart_at, [replay(endpoint, 0) for endpoint in replays], matched)


def _incarnations(frames: list[Frame]) -> list[list[Frame]]:
    runs: list[list[Frame]] = []
    for frame in frames:
        if frame.seq == 0 or not runs:
            runs.append([])
        runs[-1].append(frame)
    return runs


def test_frames_are_vllms(run: Run) -> None:
    for rank, frames in enumerate(run.frames):
        assert frames, f"engine {rank} published nothing"
        for frame in frames:
            assert frame.topic == TOPIC.encode()
            batch = frame.batch()
            assert isinstance(batch, list) and len(batch) == 3, "[ts, events, dp_rank]"
            ts, events, dp_rank = batch
            assert isinstance(ts, float) and abs(time.time() - ts) < 600
            assert dp_rank == rank, "each engine publishes its own DP rank"
            assert events, "no empty batches"
            for event in events:
                assert isinstance(event, dict), "events are maps, not positional arrays"
                assert set(event) == REQUIRED_FIELDS[event["type"]], event
                if event["type"] != "AllBlocksCleared":
                    assert event["medium"] == "GPU"
                    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in event["block_hashes"])


def test_each_incarnation_counts_from_zero_without_gaps_and_starts_cleared(run: Run) -> None:
    incarnations = [_incarnations(frames) for frames in run.frames]
    assert len(incarnations[0]) == 2, "engine 0 was restarted once"
    assert len(incarnations[1]) == 1, "engine 1 was not"
    # Live, not replayed: the publisher held its first batch until the subscriber was back.
    assert run.frames[0][run.restart_at].seq == 0, "the new incarnation was heard live from 0"
    for runs in incarnations:
        for frames in runs:
            assert [f.seq for f in frames] == list(range(len(frames))), "gap-free from 0"
            assert frames[0].batch()[1][0]["type"] == "AllBlocksCleared", "first event"


def test_stored_blocks_are_whole_and_chained_to_announced_parents(run: Run) -> None:
    stored = 0
    for frames in run.frames:
        for incarnation in _incarnations(frames):
            announced: set[int] = set()
            for frame in incarnation:
                for event in frame.batch()[1]:
                    if event["type"] != "BlockStored":
                        continue
                    stored += 1
                    assert event["block_size"] == BLOCK_SIZE
                    assert len(event["token_ids"]) == BLOCK_SIZE * len(event["block_hashes"])
                    parent = event["parent_block_hash"]
                    assert parent is None or parent in announced, "parent never announced"
                    assert event["lora_id"] is None and event["lora_name"] is None
                    announced.update(event["block_hashes"])
    assert stored > 10
    removed = [
        e
        for frames in run.frames
        for f in frames
        for e in f.batch()[1]
        if e["type"] == "BlockRemoved"
    ]
    assert removed, "32 blocks are far fewer than the workload touches: blocks were evicted"


def test_the_rebuilt_index_is_the_engines_and_replay_gives_the_same_frames(run: Run) -> None:
    assert run.indexes_matched
    for frames, replayed in zip(run.frames, run.replay_after, strict=True):
        current = _incarnations(frames)[-1]
        assert [(f.seq, f.payload) for f in replayed] == [(f.seq, f.payload) for f in current]
        assert all(f.topic == TOPIC.encode() for f in replayed)


def _anchor_python() -> Path | None:
    root = Path(os.environ.get("VLLM_ANCHOR_DIR", Path.home() / ".cache" / "rankcast-anchor"))
    python = root / "venv" / "bin" / "python"
    return python if python.exists() else None


_DECODE_WITH_VLLM = """
import json, sys
import msgspec
from vllm.distributed.kv_events import KVEventBatch
import vllm
decoder = msgspec.msgpack.Decoder(KVEventBatch)
out = []
for payload in msgspec.msgpack.decode(open(sys.argv[1], "rb").read()):
    batch = decoder.decode(payload)
    out.append([batch.ts, batch.data_parallel_rank,
                [[type(e).__name__, msgspec.to_builtins(e)] for e in batch.events]])
print(json.dumps({"vllm": vllm.__version__, "batches": out}))
"""


def test_vllms_own_decoder_reads_every_frame(run: Run, tmp_path: Path) -> None:
    python = _anchor_python()
    if python is None:
        pytest.skip("no vLLM anchor install (../shared/bench/vllm/install.sh, VLLM_ANCHOR_DIR)")
    payloads = [f.payload for frames in run.frames for f in frames]
    payloads += [f.payload for replayed in run.replay_after for f in replayed]
    data = tmp_path / "frames.msgpack"
    data.write_bytes(msgspec.msgpack.encode(payloads))
    script = tmp_path / "decode.py"
    script.write_text(_DECODE_WITH_VLLM)
    done = subprocess.run(
        [str(python), str(script), str(data)],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if not k.startswith("PYTHON")},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    decoded = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"decoded by vLLM {decoded['vllm']}", file=sys.stderr)
    assert len(decoded["batches"]) == len(payloads)
    kinds = set()
    for payload, (ts, rank, events) in zip(payloads, decoded["batches"], strict=True):
        ours = msgspec.msgpack.decode(payload)
        assert (ts, rank) == (ours[0], ours[2])
        assert len(events) == len(ours[1])
        for (kind, fields), event in zip(events, ours[1], strict=True):
            kinds.add(kind)
            assert kind == event["type"]
            for name in REQUIRED_FIELDS[kind] - {"type"}:
                assert fields[name] == event[name], (kind, name)
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}


def test_discovery_names_each_engines_publisher_in_vllms_shape(tiny_chat_dir: Path) -> None:
    pub = free_port_pair()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{pub}"}
    server = ServerProcess(
        str(tiny_chat_dir),
        "--dtype=float32",
        "--kv-cache-space=0.05",
        "--data-parallel-size=2",
        "--served-model-name=tiny",
        f"--kv-events-config={json.dumps(config)}",
        api_server_count=1,
    )
    with server.running(), httpx.Client(base_url=server.url, timeout=60) as http:
        sources = http.get("/kv_event_sources").json()
        assert sorted(sources) == ["0", "1"]
        for rank in (0, 1):
            source = sources[str(rank)]
            assert source["endpoint"] == f"tcp://127.0.0.1:{pub + rank}"
            assert source["replay_endpoint"] is None
            assert source["topic"] == "" and source["publisher"] == "zmq"
        info = http.get("/get_server_info").json()["vllm_config"]
        assert info["cache_config"]["block_size"] == BLOCK_SIZE
        assert info["parallel_config"]["data_parallel_size"] == 2

        chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}]}
        rendered = http.post("/v1/chat/completions/render", json=chat).json()
        tokenized = http.post("/tokenize", json=chat).json()
        assert "tokens" in tokenized, tokenized
        tokenized = tokenized["tokens"]
        assert rendered["token_ids"] == tokenized and rendered["model"] == "tiny"
        answer = http.post("/v1/chat/completions", json={**chat, "max_tokens": 2}).json()
        assert answer["usage"]["prompt_tokens"] == len(rendered["token_ids"])
        completion = {"model": "tiny", "prompt": "Once upon a time"}
        (one,) = http.post("/v1/completions/render", json=completion).json()
        assert one["token_ids"] == http.post("/tokenize", json=completion).json()["tokens"]
        unknown = http.post("/v1/chat/completions/render", json={**chat, "model": "nope"})
        assert unknown.status_code == 404
    # Without a vLLM-format publisher the answer is vLLM's: nothing.
    plain = ServerProcess(
        str(tiny_chat_dir),
        "--dtype=float32",
        "--kv-cache-space=0.05",
        api_server_count=1,
        port=free_port(),
    )
    with plain.running():
        assert httpx.get(f"{plain.url}/kv_event_sources", timeout=30).json() == {}
