"""The LoRA registry's host tier when a read may take a parked adapter's place (`prepare`'s
`spare`): which one goes, and when it leaves. No ranks: `prepare` only plans moves, and the
ranks' replies are handed in as `update_from_reads` receives them from a step."""

from __future__ import annotations

from rankcast.config import LoRAConfig
from rankcast.engine_core.lora_registry import LoRARegistry, RegisteredAdapter, startup_share
from rankcast.protocol import AdapterRead, LoRAMove

# "b" runs on the only device slot; "a" and "p" are parked (requests name them, out of the
# slots), "p" used more recently; "d" is on disk. The tier holds 3.
IN_FLIGHT = {"a", "b", "p"}


def _registry() -> LoRARegistry:
    registry = LoRARegistry(
        None,  # type: ignore[arg-type]  # no ranks: nothing here calls one
        None,  # type: ignore[arg-type]
        LoRAConfig(enable_lora=True, max_loras=1, max_cpu_loras=3),
        lambda name: 1 if name in IN_FLIGHT else 0,
        lambda: set(IN_FLIGHT),
    )
    registry.adapters = {
        "a": RegisteredAdapter("a", "/adapters/a", 1, 8, 4096, in_host=True, last_used=1),
        "p": RegisteredAdapter("p", "/adapters/p", 2, 8, 4096, in_host=True, last_used=2),
        "b": RegisteredAdapter("b", "/adapters/b", 3, 8, 4096, True, slot=0, last_used=3),
        "d": RegisteredAdapter("d", "/adapters/d", 4, 8, 4096),
    }
    return registry


def _evicted(registry: LoRARegistry) -> list[str]:
    ids = {a.adapter_id: a.name for a in registry.adapters.values()}
    return [ids[m.adapter_id] for m in registry.take_moves() if m.action == "evict"]


def test_without_spare_a_full_tier_of_adapters_in_flight_has_no_room() -> None:
    registry = _registry()
    assert registry.prepare("d", set(IN_FLIGHT)) == "no_room"
    assert registry.take_moves() == []


def test_a_read_takes_the_most_recently_used_parked_place_which_leaves_when_it_is_done() -> None:
    registry = _registry()
    assert registry.prepare("d", set(IN_FLIGHT), frozenset({"a", "p"})) == "reading"
    moves = registry.take_moves()
    assert [(m.action, m.name) for m in moves] == [("read_async", "d")]
    assert registry.adapters["p"].leaving and not registry.adapters["a"].leaving
    assert registry.adapters["p"].in_host, "it stays until the read is done"
    registry.update_from_reads([[AdapterRead(4, "d")]])
    assert _evicted(registry) == ["p"], "in flight, but parked: its place goes"
    assert not registry.adapters["p"].in_host and registry.adapters["d"].in_host
    assert registry.whereabouts("p") == "disk" and registry.undo_displacement("p")


def test_a_parked_adapter_back_in_a_slot_before_the_read_is_done_stays() -> None:
    registry = _registry()
    assert registry.prepare("d", set(IN_FLIGHT), frozenset({"p"})) == "reading"
    registry.take_moves()
    registry.adapters["b"].slot, registry.adapters["p"].slot = None, 0  # "p" resumed
    registry.update_from_reads([[AdapterRead(4, "d")]])
    assert _evicted(registry) == []
    assert registry.adapters["p"].in_host and registry.adapters["p"].slot == 0


def test_only_parked_adapters_out_of_the_slots_and_unpinned_are_spare() -> None:
    registry = _registry()
    registry.adapters["p"].pinned = True
    spare = frozenset({"b", "p"})  # "b" holds the slot, "p" is pinned
    assert registry.prepare("d", set(IN_FLIGHT), spare) == "no_room"
    assert registry.take_moves() == []


def test_a_failed_read_gives_the_parked_adapter_its_place_back() -> None:
    registry = _registry()
    assert registry.prepare("d", set(IN_FLIGHT), frozenset({"p"})) == "reading"
    registry.take_moves()
    registry.update_from_reads([[AdapterRead(4, "d", error="adapter_config.json vanished")]])
    moves: list[LoRAMove] = registry.take_moves()
    assert [(m.action, m.adapter_id) for m in moves] == [("evict", 4)]
    assert registry.adapters["p"].in_host and not registry.adapters["p"].leaving


def test_data_parallel_engines_start_with_the_listed_adapters_round_robin() -> None:
    """Each engine wants its own share resident first, then the rest as listed: the group
    holds different adapters, the first listed spread over the engines."""
    names = [f"a{i}" for i in range(5)]
    assert startup_share(names, 0, 2) == ["a0", "a2", "a4", "a1", "a3"]
    assert startup_share(names, 1, 2) == ["a1", "a3", "a0", "a2", "a4"]
    assert startup_share(names, 0, 1) == names
