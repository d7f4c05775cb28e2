"""The other direction of the golden fixtures: what the Rust mirror (`rust/wire`) encodes, the
Python side decodes, with the meaning it was given, a newer peer's trailing field included."""

from __future__ import annotations

import subprocess
from pathlib import Path

import msgspec
import pytest

from rankcast.channel.events import AnyNotification, CustomNotification, LoRAAdapterEvicted
from rankcast.protocol import (
    PROTOCOL_VERSION,
    AbortRequests,
    ClientHello,
    EngineCoreInput,
    EngineCoreMessage,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    UtilityRequest,
)
from tests.rust_build import binary


@pytest.fixture(scope="module")
def samples(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("rust-samples")
    subprocess.run([binary("wire_samples"), out], check=True, timeout=60)
    return out


def _input(samples: Path, name: str) -> EngineCoreInput:
    return msgspec.msgpack.decode((samples / f"{name}.msgpack").read_bytes(), type=EngineCoreInput)


def test_a_rust_hello_and_a_newer_rust_hello_decode(samples: Path) -> None:
    assert _input(samples, "input_client_hello") == ClientHello(PROTOCOL_VERSION, 2)
    # Four fields where this side knows three: the trailing one is skipped.
    assert _input(samples, "input_client_hello_newer") == ClientHello(PROTOCOL_VERSION, 3)


def test_a_rust_request_decodes_with_its_sampling_parameters(samples: Path) -> None:
    request = _input(samples, "input_add_request")
    assert isinstance(request, EngineCoreRequest)
    assert request.request_id == "rust-1"
    assert request.prompt_token_ids == [1, 9690, 28, 2, 70000]
    params = request.sampling_params
    assert (params.temperature, params.top_k, params.seed) == (0.5, 40, -7)
    assert params.max_tokens is None  # given as nil: not the default 16
    assert params.stop == ["\n\n", "END"] and params.logprobs == 3
    assert params.prompt_logprobs == 1
    assert params.top_p == 1.0 and params.skip_special_tokens  # left out: defaults
    assert params.structured is not None and params.structured.regex == "[a-z]+"
    assert (request.arrival_time, request.client_index, request.lora_name) == (
        1700000003.25,
        2,
        "sql",
    )


def test_rust_abort_and_utility_calls_decode(samples: Path) -> None:
    assert _input(samples, "input_abort") == AbortRequests(["rust-1"])
    assert _input(samples, "input_utility") == UtilityRequest(
        9, "add_lora", ["sql", "/adapters/sql", {"pinned": True}]
    )


def test_rust_outputs_and_the_notifications_they_carry_decode(samples: Path) -> None:
    message = msgspec.msgpack.decode(
        (samples / "output_step.msgpack").read_bytes(), type=EngineCoreMessage
    )
    assert isinstance(message, EngineCoreOutputs)
    (output,) = message.outputs
    assert output.new_token_ids == [42, 43] and output.finish_reason is FinishReason.LENGTH
    assert output.prompt_logprobs is not None
    assert [(lp.token_id, lp.rank) for lp in output.prompt_logprobs] == [
        (9690, 7),
        (28, 1),
        (2, 2),
        (70000, 4000),
    ]
    assert output.prompt_logprobs[0].top_token_ids == [28]
    assert message.scheduler_stats is not None
    assert message.scheduler_stats.running_lora_requests == {"sql": 1}
    stats = message.scheduler_stats
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens) == (4, 12)
    assert stats.spec_decode_num_accepted_tokens == 7
    assert stats.spec_decode_num_accepted_tokens_per_pos == [4, 2, 1]
    assert message.finished_requests == ["rust-1"]
    assert message.engine_notifications is not None
    decoder = msgspec.msgpack.Decoder(AnyNotification)
    custom, evicted = (decoder.decode(raw) for raw in message.engine_notifications)
    assert isinstance(custom, CustomNotification)
    assert custom.key == "rust.frontend_started"
    assert custom.payload == {"pid": 4321, "note": "héllo ✓"}
    assert (custom.seq, custom.engine_seq, custom.tp_rank, custom.rank) == (3, 11, 2, 2)
    assert isinstance(evicted, LoRAAdapterEvicted)
    assert (evicted.adapter_name, evicted.reason, evicted.rank) == ("chat", "lru", 1)
    assert evicted.timestamp == 0.0  # a default the Rust side left out of the map


def test_rust_encodes_what_python_encodes_for_the_same_message(samples: Path) -> None:
    """Byte for byte, not only in meaning: the Rust sample re-encoded by msgspec is unchanged."""
    for name in ("input_client_hello", "input_add_request", "input_abort", "input_utility"):
        raw = (samples / f"{name}.msgpack").read_bytes()
        decoded = msgspec.msgpack.decode(raw, type=EngineCoreInput)
        assert msgspec.msgpack.encode(decoded) == raw, name
    raw = (samples / "output_step.msgpack").read_bytes()
    decoded = msgspec.msgpack.decode(raw, type=EngineCoreMessage)
    assert msgspec.msgpack.encode(decoded) == raw
