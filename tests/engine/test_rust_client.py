"""The Rust engine-core client (`rust/client`) against a real engine core process: the same
handshake, snapshot, requests, outputs and utility calls as the Python client, and a peer of
another protocol version refused with both versions named, in either direction."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from rankcast.addresses import EngineAddresses
from rankcast.channel.snapshot import EngineStateSnapshot
from rankcast.protocol import (
    PROTOCOL_VERSION,
    ClientHello,
    EngineCoreInput,
    EngineCoreOutputs,
    EngineReady,
)
from tests.engine.engine_process import engine_core_process, python_greedy
from tests.rust_build import binary

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Iterator[EngineAddresses]:
    """One engine core with two client slots: 0 for the Python client, 1 for the Rust one."""
    with engine_core_process(tiny_llama_dir) as (_, addresses):
        yield addresses


def _probe(addresses: EngineAddresses, *options: str) -> subprocess.CompletedProcess[str]:
    client = addresses.clients[1]
    return subprocess.run(
        [binary("engine_probe"), client.input, client.output, "1", *options],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _lines(stdout: str, prefix: str) -> list[str]:
    return [line[len(prefix) + 1 :] for line in stdout.splitlines() if line.startswith(prefix)]


def test_the_rust_client_generates_what_the_python_client_generates(
    engine: EngineAddresses,
) -> None:
    result = _probe(engine, "--prompt", ",".join(map(str, PROMPT)), "--max-tokens", "6")
    assert result.returncode == 0, result.stderr
    (ready,) = _lines(result.stdout, "ready")
    fields = dict(item.split("=", 1) for item in ready.split())
    assert fields["num_blocks"] == "64" and fields["incarnation"] == "0"
    assert fields["weights_loaded_ranks"] == "0", "the snapshot carries rank 0's weight load"
    (tokens,) = _lines(result.stdout, "tokens")
    assert [int(t) for t in tokens.split()] == python_greedy(engine, 0, PROMPT, 6)
    assert _lines(result.stdout, "finish") == ["length"]


def test_the_rust_client_calls_utilities_and_reads_error_kinds(engine: EngineAddresses) -> None:
    ok = _probe(engine, "--utility", "ping")
    assert ok.returncode == 0, ok.stderr
    assert _lines(ok.stdout, "utility") == ['ping ok Str("pong")']
    refused = _probe(engine, "--utility", "list_loras")
    assert _lines(refused.stdout, "utility") == [
        "list_loras error bad_argument LoRA is not enabled on this engine (--enable-lora)"
    ]
    bad = _probe(engine, "--utility", "no_such_utility")
    assert bad.returncode == 0, bad.stderr
    (line,) = _lines(bad.stdout, "utility")
    assert line.startswith("no_such_utility error unknown_method unknown utility"), line


def test_an_older_rust_peer_is_refused_naming_both_versions(engine: EngineAddresses) -> None:
    result = _probe(engine, "--protocol-version", str(PROTOCOL_VERSION - 1))
    assert result.returncode == 2, result.stdout + result.stderr
    (refusal,) = _lines(result.stdout, "refused:")
    assert f"engine core speaks {PROTOCOL_VERSION}" in refusal
    assert f"speaks {PROTOCOL_VERSION - 1}" in refusal


def _probe_a_fake_engine(
    tmp_path: Path, client_index: int, replies: list[object]
) -> tuple[list[EngineCoreInput], subprocess.CompletedProcess[str]]:
    """Run the probe against a socket pair playing the engine: it answers the hello with
    `replies`, in order. For engines this tree cannot be made into (a fault not produced
    otherwise). Returns what the probe sent and how it ended."""
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    push = context.socket(zmq.PUSH)
    pull.bind(f"ipc://{tmp_path}/in")
    push.bind(f"ipc://{tmp_path}/out")
    seen: list[EngineCoreInput] = []

    def answer() -> None:
        if pull.poll(60_000):
            seen.append(msgspec.msgpack.decode(pull.recv(), type=EngineCoreInput))
            for reply in replies:
                push.send(msgspec.msgpack.encode(reply))

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        result = subprocess.run(
            [
                binary("engine_probe"),
                f"ipc://{tmp_path}/in",
                f"ipc://{tmp_path}/out",
                str(client_index),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        thread.join(70)
        context.destroy(linger=0)
    return seen, result


def test_the_rust_client_refuses_an_engine_of_another_version(tmp_path: Path) -> None:
    """An engine core of a newer protocol cannot be built from this tree."""
    seen, result = _probe_a_fake_engine(tmp_path, 4, [EngineReady(PROTOCOL_VERSION + 1, pid=1)])
    assert seen == [ClientHello(PROTOCOL_VERSION, 4)]
    assert result.returncode == 2, result.stdout + result.stderr
    (refusal,) = _lines(result.stdout, "refused:")
    assert f"engine core speaks {PROTOCOL_VERSION + 1}" in refusal
    assert f"this client speaks {PROTOCOL_VERSION}" in refusal


def test_what_the_engine_queued_for_a_predecessor_is_skipped_at_the_handshake(
    tmp_path: Path,
) -> None:
    """A restarted API server's slot may still hold what the engine sent its predecessor;
    the Rust client skips it and takes the EngineReady, as the Python client does (the fake
    engine puts that message first every time)."""
    ready = EngineReady(PROTOCOL_VERSION, pid=1, snapshot=EngineStateSnapshot(0, 7))
    _, result = _probe_a_fake_engine(
        tmp_path, 2, [EngineCoreOutputs(engine_index=0, timestamp=1.0), ready]
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (line,) = _lines(result.stdout, "ready")
    assert "engine_seq=7" in line
