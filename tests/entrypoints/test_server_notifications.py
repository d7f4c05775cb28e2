"""Rules 5-9 through real processes: a TP=2 engine, three API servers on one port.

Every worker rank's events reach every API server in the same order, whether published while
idle or mid-generation; overflow shows on every server; a bad payload fails at the producer;
`/v1/events` resumes; the ZMQ stream replays; a restarted API server catches up and agrees.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from rankcast.channel.decoder import NotificationDecoder
from rankcast.channel.events import NotificationBatch
from rankcast.channel.snapshot import EngineStateSnapshot
from rankcast.channel.stream import END_OF_REPLAY, SNAPSHOT_REQUEST, TOPIC
from tests.entrypoints.notification_clients import (
    open_event_streams,
    producer_server_args,
    scrape_each,
    series,
    worker_rpc,
)
from tests.entrypoints.server_process import ServerProcess, free_port
from tests.worker.producers import KEY

SERVERS = 3
BUFFER = 16
CHANNEL_SERIES = (
    "rankcast:engine_notifications_total",
    "rankcast:worker_notifications_dropped_total",
    "rankcast:worker_weights_load_seconds",
    "rankcast:worker_weights_load_bytes",
)


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[ServerProcess]:
    pub, replay = free_port(), free_port()
    proc = ServerProcess(
        *producer_server_args(tiny_llama_dir, "--tensor-parallel-size", "2"),
        "--worker-notification-buffer-size",
        str(BUFFER),
        "--notification-events-endpoint",
        f"tcp://127.0.0.1:{pub}",
        "--notification-events-replay-endpoint",
        f"tcp://127.0.0.1:{replay}",
        api_server_count=SERVERS,
    )
    proc.pub_endpoint = f"tcp://127.0.0.1:{pub}"  # type: ignore[attr-defined]
    proc.replay_endpoint = f"tcp://127.0.0.1:{replay}"  # type: ignore[attr-defined]
    with proc.running():
        yield proc


def test_every_api_server_reports_each_ranks_weight_load(server: ServerProcess) -> None:
    scrapes = scrape_each(server.url, SERVERS)
    loads = {
        i: series(text, "rankcast:worker_weights_load_seconds{") for i, text in scrapes.items()
    }
    for lines in loads.values():
        assert [line.split(" ")[0] for line in lines] == [
            'rankcast:worker_weights_load_seconds{engine="0",rank="0"}',
            'rankcast:worker_weights_load_seconds{engine="0",rank="1"}',
        ]
    assert len({tuple(lines) for lines in loads.values()}) == 1, "every server agrees"


def test_events_from_every_rank_reach_every_api_server_in_the_same_order(
    server: ServerProcess,
) -> None:
    readers = open_event_streams(server.url, SERVERS, params={"key": KEY})
    try:
        response = worker_rpc(server.url, "publish_events", 4)
        assert response.status_code == 200, response.text
        assert response.json() == {"results": [[0, 1]]}
        streams = {i: r.wait_for(8) for i, r in readers.items()}
        first = streams["0"]
        assert [(d["rank"], d["payload"]["i"]) for _, d in first] == [
            (r, i) for r in (0, 1) for i in range(4)
        ]
        assert all(d["tp_rank"] == d["rank"] and d["engine_index"] == 0 for _, d in first)
        for stream in streams.values():
            assert stream == first, "same events, same order, same ids on every server"

        # Published by a worker thread while no request runs and no call is in flight: only
        # the doorbell (no poll is configured) can bring it out.
        worker_rpc(server.url, "publish_later", 0.3)
        for reader in readers.values():
            later = reader.wait_for(10)[8:]
            assert sorted(d["rank"] for _, d in later) == [0, 1]
            assert all(d["payload"]["later"] for _, d in later)
    finally:
        for reader in readers.values():
            reader.close()


def _running_line(url: str) -> str:
    """The running-requests series of one scrape, if it shows a request running."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    lines = series(text, "vllm:num_requests_running{")
    return next((line for line in lines if not line.endswith(" 0.0")), "")


def test_an_event_published_mid_generation_arrives_before_the_request_ends(
    server: ServerProcess,
) -> None:
    readers = open_event_streams(server.url, SERVERS, params={"key": "test.mid"})
    done = threading.Event()

    def generate() -> None:
        with httpx.Client(timeout=120) as http:
            http.post(
                f"{server.url}/v1/completions",
                json={"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True},
            )
        done.set()

    worker = threading.Thread(target=generate)
    try:
        worker.start()
        deadline = time.monotonic() + 60
        while "vllm:num_requests_running" not in _running_line(server.url):
            assert time.monotonic() < deadline, "the request never started running"
            time.sleep(0.02)
        worker_rpc(server.url, "publish_later", 0.2, "test.mid", [1])
        for reader in readers.values():
            (_, event), *_ = reader.wait_for(1, timeout_s=60)
            assert event["rank"] == 1
        assert not done.is_set(), "the event waited for the request to finish"
    finally:
        worker.join()
        for reader in readers.values():
            reader.close()


def test_overflow_drops_the_oldest_and_every_server_counts_it(server: ServerProcess) -> None:
    response = worker_rpc(server.url, "publish_events", BUFFER + 9, "test.flood", [1])
    assert response.status_code == 200
    want = 'rankcast:worker_notifications_dropped_total{engine="0",rank="1"} 9.0'
    for index, text in scrape_each(server.url, SERVERS).items():
        assert want in series(text, "rankcast:worker_notifications_dropped_total"), index
        flood = series(text, 'rankcast:engine_notifications_total{key="test.flood"')
        assert flood == ['rankcast:engine_notifications_total{key="test.flood",type="custom"} 16.0']


def test_a_bad_payload_is_refused_at_the_producer_and_the_engine_keeps_serving(
    server: ServerProcess,
) -> None:
    response = worker_rpc(server.url, "publish_bad_payload")
    assert response.status_code == 400
    assert "payload['ok'][1]['bad']" in response.json()["error"]["message"]
    # A method no extension has is a thing that does not exist, as an unknown model is.
    assert worker_rpc(server.url, "no_such_method").status_code == 404
    with httpx.Client(timeout=60) as http:
        ok = http.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_events_resume_from_last_event_id(server: ServerProcess) -> None:
    readers = open_event_streams(server.url, 1, params={"key": "test.resume"})
    (reader,) = readers.values()
    try:
        worker_rpc(server.url, "publish_events", 3, "test.resume")
        seen = reader.wait_for(6)
    finally:
        reader.close()
    # Resume after the second event, on whichever server the kernel picks: ids are the same.
    resumed = open_event_streams(
        server.url, 1, params={"key": "test.resume"}, headers={"Last-Event-ID": seen[1][0]}
    )
    (again,) = resumed.values()
    try:
        assert again.wait_for(4) == seen[2:]
        assert again.controls == []
    finally:
        again.close()
    with httpx.Client(timeout=10) as http:
        bad = http.get(f"{server.url}/v1/events", headers={"Last-Event-ID": "nonsense"})
    assert bad.status_code == 400


def test_zmq_stream_publishes_replays_and_snapshots(server: ServerProcess) -> None:
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    sub.connect(server.pub_endpoint)  # type: ignore[attr-defined]
    replay = context.socket(zmq.DEALER)
    replay.connect(server.replay_endpoint)  # type: ignore[attr-defined]
    decoder = NotificationDecoder()
    try:
        deadline = time.monotonic() + 30
        got: list = []
        while not any(getattr(n, "key", None) == "test.zmq" for n in got):
            # A SUB socket joins asynchronously: publish until a batch comes through. (The
            # load-time batch, held for the first subscriber, may come first.)
            worker_rpc(server.url, "publish_events", 1, "test.zmq", [0])
            if sub.poll(1000):
                topic, seq, payload = sub.recv_multipart()
                batch = msgspec.msgpack.decode(payload, type=NotificationBatch)
                got, _ = decoder.decode(batch.notifications)
            assert time.monotonic() < deadline, "nothing on the PUB socket"
        assert topic == TOPIC and len(seq) == 8
        assert got[0].key == "test.zmq"  # type: ignore[attr-defined]
        first_seq = int.from_bytes(seq, "big")

        replay.send_multipart([b"", first_seq.to_bytes(8, "big")])
        replayed = []
        while True:
            assert replay.poll(10_000), "replay did not answer"
            _, batch_topic, batch_seq, payload = replay.recv_multipart()
            if batch_seq == END_OF_REPLAY:
                assert batch_topic == b"" and payload == b""
                break
            assert batch_topic == TOPIC
            replayed.append(int.from_bytes(batch_seq, "big"))
        assert replayed and replayed[0] == first_seq

        replay.send_multipart([b"", SNAPSHOT_REQUEST])
        assert replay.poll(10_000)
        _, _, _, state = replay.recv_multipart()
        snapshot = msgspec.msgpack.decode(state, type=EngineStateSnapshot)
        totals = {(t.type, t.key): t.count for t in snapshot.notifications.totals}
        assert totals[("custom", "rankcast.weights_loaded")] == 2
        assert totals[("custom", "test.zmq")] >= 1
    finally:
        context.destroy(linger=0)


def test_a_restarted_api_server_resumes_exactly_after_its_snapshot(server: ServerProcess) -> None:
    """Self-contained: it publishes its own history. After API server 2 restarts (and starts
    from the engine's snapshot), a client resuming from the last event before the restart gets,
    from every server, exactly the events after it: no replay_gap, no duplicate, no hole. And
    the restarted server's counters, built from snapshot plus stream, agree with the others'."""
    (reader,) = open_event_streams(server.url, 1).values()
    try:
        worker_rpc(server.url, "publish_events", 2, "test.before")  # 2 per rank, TP=2
        history = reader.wait_for(4)
    finally:
        reader.close()
    last_id = history[-1][0]
    server.kill_and_await_restart("api_server_2")
    resumed = open_event_streams(server.url, SERVERS, headers={"Last-Event-ID": last_id})
    try:
        worker_rpc(server.url, "publish_events", 1, "test.after")  # one per rank
        engine, incarnation, seq = last_id.split(":")
        want = [f"{engine}:{incarnation}:{int(seq) + i}" for i in (1, 2)]
        for name, stream in resumed.items():
            stream.wait_for(2)
            assert [event_id for event_id, _ in stream.events] == want, f"API server {name}"
            assert stream.controls == [], f"API server {name} announced a gap"
    finally:
        for stream in resumed.values():
            stream.close()
    deadline = time.monotonic() + 30
    while True:
        scrapes = scrape_each(server.url, SERVERS)
        views = {i: series(text, *CHANNEL_SERIES) for i, text in scrapes.items()}
        if len({tuple(v) for v in views.values()}) == 1:
            break
        assert time.monotonic() < deadline, f"servers disagree: {views}"
        time.sleep(0.2)
    assert any('key="test.after"' in line for line in views["2"])
    assert any('key="test.before"' in line for line in views["2"]), "history came from snapshot"
