"""An API server's adapter residency, built from lifecycle events alone: the rules a router
relies on (an evicted adapter stays servable, `partial` when ranks disagree, unload forgets)."""

from __future__ import annotations

from rankcast.api_server.metrics.lora_residency import LoRAResidency
from rankcast.channel.events import (
    LoRAAdapterActivated,
    LoRAAdapterEvicted,
    LoRAAdapterLoaded,
    LoRAAdapterPinned,
    Notification,
)


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


def _residency(*events: Notification) -> LoRAResidency:
    residency = LoRAResidency()
    residency.world_size[0] = 2
    residency.consume(list(events), [], 0.0)
    return residency


def test_ranks_that_disagree_are_partial_until_they_agree() -> None:
    half = _residency(_loaded(0), _loaded(1), _activated(0))
    (adapter,) = half.describe()
    assert adapter["partial"] is True and adapter["tiers"] == ["device", "cpu"]
    half.consume([_activated(1)], [], 0.0)
    assert half.describe()[0]["partial"] is False
    half.consume([_on(0, LoRAAdapterPinned(adapter_name="a", adapter_id=1, tier="device"))], [], 0)
    assert half.describe()[0]["partial"] is True, "pinned on one rank only"


def test_an_adapter_evicted_from_every_tier_stays_servable_until_unloaded() -> None:
    residency = _residency(
        *(_loaded(r) for r in (0, 1)),
        *(_activated(r) for r in (0, 1)),
        *(_evicted(r, "cpu", "capacity") for r in (0, 1)),
    )
    assert residency.names() == ["a"]
    assert residency.describe()[0]["tiers"] == []
    residency.consume([_evicted(r, "disk", "unload") for r in (0, 1)], [], 0.0)
    assert residency.names() == []


def test_an_adapter_that_failed_to_load_is_forgotten_on_every_rank() -> None:
    """Rank 1 could not read it; rank 0 had, and rolls back: the engine dropped the adapter."""
    residency = _residency(_loaded(0))
    residency.consume([_evicted(0, "cpu", "load_failed")], [], 0.0)
    assert residency.names() == []


def test_unload_from_the_device_forgets_the_adapter_once_every_rank_reported() -> None:
    residency = _residency(*(_loaded(r) for r in (0, 1)), *(_activated(r) for r in (0, 1)))
    for rank in (0, 1):
        residency.consume([_evicted(rank, "device", "unload")], [], 0.0)
        assert residency.names() == ["a"]
        residency.consume([_evicted(rank, "cpu", "unload")], [], 0.0)
    assert residency.names() == []
