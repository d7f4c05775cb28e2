"""An API server's adapter residency, as its engine views build it from lifecycle events alone:
the rules a router relies on (an evicted adapter stays servable, `partial` when ranks disagree,
unload forgets)."""

from __future__ import annotations

from rankcast.channel.events import (
    LoRAAdapterActivated,
    LoRAAdapterEvicted,
    LoRAAdapterLoaded,
    LoRAAdapterPinned,
    Notification,
)
from rankcast.channel.view import LoRAShape
from rankcast.engine_client.engine_views import EngineViews


def _on(rank: int, n: Notification) -> Notification:
    n.engine_index, n.rank = 0, rank
    return n


def _loaded(rank: int) -> Notification:
    return _on(rank, LoRAAdapterLoaded(adapter_name="a", adapter_id=1, tier="cpu", seconds=0.1))


def _activated(rank: int) -> Notification:
    return _on(
        rank,
        LoRAAdapterActivated(adapter_name="a", adapter_id=1, tier="device", seconds=0.1, slot=0),
    )


def _evicted(rank: int, tier: str, reason: str) -> Notification:
    return _on(rank, LoRAAdapterEvicted(adapter_name="a", adapter_id=1, tier=tier, reason=reason))


def _residency(*events: Notification) -> EngineViews:
    residency = EngineViews(1)
    residency[0].lora = LoRAShape(world_size=2, max_loras=1, max_cpu_loras=4)
    residency.consume(0, list(events), [])
    return residency


def test_ranks_that_disagree_are_partial_until_they_agree() -> None:
    half = _residency(_loaded(0), _loaded(1), _activated(0))
    (adapter,) = half.describe_adapters()
    assert adapter["partial"] is True and adapter["tiers"] == ["device", "cpu"]
    half.consume(0, [_activated(1)], [])
    assert half.describe_adapters()[0]["partial"] is False
    half.consume(0, [_on(0, LoRAAdapterPinned(adapter_name="a", adapter_id=1, tier="device"))], [])
    assert half.describe_adapters()[0]["partial"] is True, "pinned on one rank only"


def test_an_adapter_evicted_from_every_tier_stays_servable_until_unloaded() -> None:
    residency = _residency(
        *(_loaded(r) for r in (0, 1)),
        *(_activated(r) for r in (0, 1)),
        *(_evicted(r, "cpu", "capacity") for r in (0, 1)),
    )
    assert residency.adapter_names() == ["a"]
    assert residency.describe_adapters()[0]["tiers"] == []
    residency.consume(0, [_evicted(r, "disk", "unload") for r in (0, 1)], [])
    assert residency.adapter_names() == []


def test_an_adapter_that_failed_to_load_is_forgotten_on_every_rank() -> None:
    """Rank 1 could not read it; rank 0 had, and rolls back: the engine dropped the adapter."""
    residency = _residency(_loaded(0))
    residency.consume(0, [_evicted(0, "cpu", "load_failed")], [])
    assert residency.adapter_names() == []


def test_unload_from_the_device_forgets_the_adapter_once_every_rank_reported() -> None:
    residency = _residency(*(_loaded(r) for r in (0, 1)), *(_activated(r) for r in (0, 1)))
    for rank in (0, 1):
        residency.consume(0, [_evicted(rank, "device", "unload")], [])
        assert residency.adapter_names() == ["a"]
        residency.consume(0, [_evicted(rank, "cpu", "unload")], [])
    assert residency.adapter_names() == []
