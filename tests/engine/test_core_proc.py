"""The engine core in its own process: handshake, routing to owners, stats to all, utilities."""

from __future__ import annotations

import time
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest

from rankcast.addresses import EngineAddresses
from rankcast.engine_client.mp_client import (
    EngineDeadError,
    ProtocolMismatchError,
    SyncMPClient,
    UtilityError,
)
from rankcast.protocol import EngineCoreOutputs, EngineCoreRequest, ErrorKind, GetStats
from rankcast.sampling_params import SamplingParams
from tests.engine.engine_process import engine_core_process


@pytest.fixture()
def engine(tiny_llama_dir: Path) -> Iterator[tuple[BaseProcess, EngineAddresses]]:
    with engine_core_process(tiny_llama_dir) as running:
        yield running


def _collect(client: SyncMPClient, request_id: str, deadline_s: float = 60) -> list[int]:
    tokens: list[int] = []
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        message = client.get_output(timeout_s=deadline_s)
        for output in message.outputs:
            assert output.request_id == request_id, "outputs go only to the owner"
            tokens.extend(output.new_token_ids)
            if output.finished:
                return tokens
    raise AssertionError("request did not finish")


def test_outputs_go_to_their_owner_and_stats_to_everyone(engine) -> None:
    _, addresses = engine
    first = SyncMPClient(addresses.clients[0], 0)
    second = SyncMPClient(addresses.clients[1], 1)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        first.add_request(EngineCoreRequest("a", [5, 6, 7], params, client_index=0))
        assert len(_collect(first, "a")) == 5
        # The second client saw no request outputs, but it did get scheduler stats.
        seen_stats = False
        while True:
            try:
                message = second.get_output(timeout_s=1)
            except TimeoutError:
                break
            assert isinstance(message, EngineCoreOutputs) and not message.outputs
            seen_stats |= message.scheduler_stats is not None
        assert seen_stats
        assert first.call_utility("ping") == "pong"
        assert second.call(GetStats()).num_running_reqs == 0
        with pytest.raises(UtilityError, match="unknown utility 'nope'") as refused:
            first.call_utility("nope")
        assert refused.value.kind is ErrorKind.UNKNOWN_METHOD
        # Arguments that do not fit the verb's struct are the caller's error, named.
        with pytest.raises(UtilityError, match="utility 'pin_lora': ") as misfit:
            first.call_utility("pin_lora", 3, "yes")
        assert misfit.value.kind is ErrorKind.BAD_ARGUMENT
    finally:
        first.shutdown()
        second.shutdown()


def test_protocol_mismatch_is_refused_clearly(engine, monkeypatch: pytest.MonkeyPatch) -> None:
    _, addresses = engine
    monkeypatch.setattr("rankcast.engine_client.mp_client.PROTOCOL_VERSION", 999)
    with pytest.raises(ProtocolMismatchError, match="protocol version mismatch"):
        SyncMPClient(addresses.clients[0], 0)


def test_client_notices_a_dead_engine(engine) -> None:
    proc, addresses = engine
    client = SyncMPClient(addresses.clients[0], 0)
    try:
        proc.kill()
        proc.join(10)
        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            while True:
                client.get_output(timeout_s=10)
        assert time.monotonic() - start < 5
    finally:
        client.shutdown()
