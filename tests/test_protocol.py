"""The wire contract: golden fixtures decode to their documented values and re-encode exactly."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from rankcast.protocol import (
    EngineCoreInput,
    EngineCoreMessage,
    EngineCoreOutputs,
    SchedulerStats,
    UtilityOutput,
)
from tests.fixtures.wire.generate import describe, fixtures, schema_lines

WIRE = Path(__file__).parent / "fixtures" / "wire"
NAMES = sorted(p.stem for p in WIRE.glob("*.msgpack"))


def test_every_fixture_is_committed() -> None:
    assert set(NAMES) == set(fixtures()), "regenerate fixtures when adding a message"


@pytest.mark.parametrize("name", NAMES)
def test_fixture_decodes_and_reencodes_byte_for_byte(name: str) -> None:
    data = (WIRE / f"{name}.msgpack").read_bytes()
    union = EngineCoreInput if name.startswith("input_") else EngineCoreMessage
    decoded = msgspec.msgpack.decode(data, type=union)
    assert msgspec.msgpack.encode(decoded) == data
    # The JSON says what the bytes mean, field by field (a utility's result is typed by the
    # call, not by the message: the description names the struct its producer made).
    described = json.loads((WIRE / f"{name}.json").read_text())
    assert describe(fixtures()[name]) == described
    if not isinstance(getattr(decoded, "utility_output", None), UtilityOutput):
        assert describe(decoded) == described


@pytest.mark.parametrize("name", NAMES)
def test_current_code_still_writes_the_fixture(name: str) -> None:
    """A changed struct shows here first: bump PROTOCOL_VERSION and regenerate on purpose."""
    assert msgspec.msgpack.encode(fixtures()[name]) == (WIRE / f"{name}.msgpack").read_bytes()


def test_decoder_ignores_unknown_trailing_fields() -> None:
    """A newer peer may append fields; an older decoder must still read what it knows."""
    newer = msgspec.msgpack.encode(
        [
            "outputs",
            0,
            [],
            [
                *(1, 2, 0.5, 0, 10, 16, 3, 0.25, ["a"], [], {"a": 1}, {}, 2.5, 40, 32, 64),
                *({"load": 1}, 16, 8, {"sql": {"device": 2}}, {"sql": 1}, "int8"),
                *(3, 6, 4, [3, 1], "future"),
            ],
            1.0,
        ]
    )
    decoded = msgspec.msgpack.decode(newer, type=EngineCoreMessage)
    assert isinstance(decoded, EngineCoreOutputs)
    assert decoded.scheduler_stats == SchedulerStats(
        1,
        2,
        0.5,
        0,
        10,
        16,
        3,
        0.25,
        ["a"],
        [],
        {"a": 1},
        {},
        2.5,
        40,
        32,
        64,
        {"load": 1},
        16,
        8,
        {"sql": {"device": 2}},
        {"sql": 1},
        "int8",
        3,
        6,
        4,
        [3, 1],
    )


def test_the_committed_schema_is_the_current_one() -> None:
    """`schema.txt` is what the Rust mirror is held to: it must say what the Python side says."""
    assert (WIRE / "schema.txt").read_text().splitlines() == schema_lines(), (
        "a wire struct changed: regenerate (python -m tests.fixtures.wire.generate) and move "
        "rust/wire with it"
    )


def test_each_utility_travels_as_the_named_call_it_always_was() -> None:
    """Verbs are structs on each side, but the wire still carries a name and positional
    arguments (what the Rust client sends): a struct's request is exactly that call."""
    from rankcast.protocol import (
        UTILITIES,
        AddLoRA,
        CollectiveRPC,
        ListLoRAs,
        PinLoRA,
        UtilityRequest,
    )

    assert sorted(UTILITIES) == sorted(
        [
            "ping",
            "get_stats",
            "snapshot",
            "collective_rpc",
            "add_lora",
            "remove_lora",
            "pin_lora",
            "list_loras",
            "reset_prefix_cache",
        ]
    )
    for utility, named in [
        (AddLoRA("sql", "/a"), UtilityRequest(4, "add_lora", ["sql", "/a"])),
        (PinLoRA("sql"), UtilityRequest(4, "pin_lora", ["sql", True])),
        (ListLoRAs(), UtilityRequest(4, "list_loras", [])),
        (CollectiveRPC("f", [1], 2.5), UtilityRequest(4, "collective_rpc", ["f", [1], 2.5])),
    ]:
        assert msgspec.msgpack.encode(utility.to_request(4)) == msgspec.msgpack.encode(named)
        assert msgspec.convert(named.args, UTILITIES[named.method]) == utility
    assert {m for m, c in UTILITIES.items() if c.CHANGES_PRODUCERS} == {
        "collective_rpc",
        "add_lora",
        "remove_lora",
        "pin_lora",
    }


def test_every_verb_has_exactly_one_handler_in_its_process_table() -> None:
    """Adding a verb is its struct, its handler and its test: a struct without a handler (or
    a handler for a struct the wire does not name) fails here, not in production."""
    from pathlib import Path

    from rankcast.config import EngineConfig
    from rankcast.engine_core.core import EngineCore
    from rankcast.model_files.source import ModelSource
    from rankcast.protocol import RANK_CALLS, UTILITIES
    from rankcast.worker.worker import Worker

    source = ModelSource(Path("unused"), Path("unused"), "unused")
    worker = Worker(EngineConfig.from_kwargs(), source)
    assert set(worker.rank_call_handlers) == set(RANK_CALLS.values())
    core = EngineCore.__new__(EngineCore)  # the table only: no model, no ranks
    assert set(core._utility_handlers()) == set(UTILITIES.values())
