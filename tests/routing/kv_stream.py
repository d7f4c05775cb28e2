"""A subscriber to vLLM-format KV-event streams, as a router runs one: every frame of every
engine, kept in arrival order, and the replay socket asked the way vLLM's consumers ask it."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
# The fields vLLM declares without a default: always on the wire, None when unset.
REQUIRED_FIELDS = {
    "BlockStored": {
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    },
    "BlockRemoved": {"type", "block_hashes", "medium"},
    "AllBlocksCleared": {"type"},
}


@dataclass
class Frame:
    topic: bytes
    seq: int
    payload: bytes

    def batch(self) -> list[Any]:
        """The batch as plain msgpack: `[ts, [event maps], dp_rank]`."""
        return msgspec.msgpack.decode(self.payload)


@dataclass
class KVStream:
    """Frames from one engine's PUB socket, collected on a thread."""

    endpoint: str
    topic: bytes
    frames: list[Frame] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def snapshot(self) -> list[Frame]:
        with self.lock:
            return list(self.frames)

    def events(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """(seq, event) in arrival order."""
        for frame in self.snapshot():
            for event in frame.batch()[1]:
                yield frame.seq, event


@contextlib.contextmanager
def subscribed(endpoints: list[str], topic: bytes) -> Iterator[list[KVStream]]:
    """One SUB socket per endpoint, subscribed to `topic`, read until the block ends."""
    context = zmq.Context()
    streams = [KVStream(endpoint, topic) for endpoint in endpoints]
    stop = threading.Event()
    sockets = []
    for stream in streams:
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, topic)
        sub.connect(stream.endpoint)
        sockets.append(sub)

    def read() -> None:
        poller = zmq.Poller()
        for sub in sockets:
            poller.register(sub, zmq.POLLIN)
        while not stop.is_set():
            for sub, _ in poller.poll(50):
                topic_frame, seq, payload = sub.recv_multipart()
                stream = streams[sockets.index(sub)]
                with stream.lock:
                    stream.frames.append(
                        Frame(topic_frame, int.from_bytes(seq, "big", signed=True), payload)
                    )

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield streams
    finally:
        stop.set()
        reader.join(5)
        context.destroy(linger=0)


def replay(endpoint: str, start: int, timeout_s: float = 10) -> list[Frame]:
    """Ask a replay socket for every batch from `start`, as vLLM's consumers do (a DEALER
    sending `[b"", start]`), until the end marker."""
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        frames = []
        while True:
            assert dealer.poll(int(timeout_s * 1000)), f"{endpoint} did not answer a replay"
            empty, topic, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_OF_REPLAY:
                assert topic == b"" and payload == b""
                return frames
            frames.append(Frame(topic, int.from_bytes(seq, "big"), payload))
    finally:
        context.destroy(linger=0)


def wait_for(condition: Any, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def free_port_pair() -> int:
    """A port p with p + 1 free too (data-parallel engine 1 publishes on p + 1)."""
    import socket

    for _ in range(100):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no two consecutive free ports")
