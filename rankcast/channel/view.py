"""One engine's state as its notifications describe it: the `EngineView`, kept the same way by
every process that follows an engine.

The engine core keeps one, applying each event as it is flushed, so its catch-up snapshot *is*
the view's state (`state()`), equal to the stream up to the snapshot's `engine_seq` by
construction. Every API server keeps one per engine (`rankcast/engine_client/engine_views.py`),
started from that snapshot and moved on by the same events, so routing, `/v1/lora_adapters`,
`/health`, `/metrics` and the dashboard all read one state. The Rust API server keeps the same
struct (`rust/frontend/src/view.rs`), and the page renders `as_json()` as one of them serves it.
Both languages replay the golden streams in `tests/fixtures/view/` and must end in the states
written there.

Every event type has one handler in `_HANDLERS`; every event also counts in the totals (by type
and, for `custom`, key) and, for a LoRA lifecycle event, in the adapter event counter. Of the
custom events, a rank's weight load is kept as it last reported it, and its expert load
(`expert_load.py`) added to its tokens per (layer, expert). The rules of residency, in one
place:

- a load or an activation puts the adapter in that rank's tier ("cpu" host tier, "device" slot);
- an eviction takes the tier away; from the host tier it takes everything the rank held (the
  host tier holds every adapter the rank has) and the rank's pin with it; a device eviction
  keeps the pin (only an unload evicts a pinned adapter, and its host eviction follows);
- an unload or a failed load (`reason` "unload"/"load_failed") that leaves no rank holding the
  adapter forgets it; any other eviction leaves it registered with no tier (it loads again on
  demand);
- a pin or an unpin changes that rank's pin; a failed load changes nothing but the counts.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rankcast.channel.events import (
    WEIGHTS_LOADED_KEY,
    CustomNotification,
    KVBlocksRemoved,
    KVBlocksStored,
    KVCacheCleared,
    LoRAAdapterActivated,
    LoRAAdapterEvicted,
    LoRAAdapterLoaded,
    LoRAAdapterLoadFailed,
    LoRAAdapterPinned,
    LoRAAdapterUnpinned,
    Notification,
    NotificationsDropped,
    notification_type,
)
from rankcast.channel.expert_load import EXPERT_LOAD_KEY, read_expert_load
from rankcast.channel.kv_index import KVCacheIndex
from rankcast.channel.lora_events import lora_event_key, lora_load_time
from rankcast.channel.snapshot import (
    AdapterResidency,
    EngineStateSnapshot,
    LoRAEventCount,
    LoRALoadTime,
    LoRAState,
    NotificationLedgerState,
    NotificationTotal,
    RankCount,
    RankExpertTokens,
    RankTier,
    RankWeightsLoaded,
)

# Load-time observations kept for a late API server's histogram (oldest forgotten first).
LOADS_KEPT = 10_000
# Tier order wherever tiers are listed: the device first, as the one requests run on.
TIER_ORDER = {"device": 0, "cpu": 1}


def ordered_tiers(tiers: set[str] | frozenset[str]) -> list[str]:
    return sorted(tiers, key=lambda t: (TIER_ORDER.get(t, len(TIER_ORDER)), t))


@dataclass(frozen=True)
class LoRAShape:
    """What the engine's configuration says about adapters (not events): ranks, slots."""

    world_size: int
    max_loras: int
    max_cpu_loras: int


@dataclass
class AdapterView:
    """One registered adapter: its engine id, the tiers each rank holds it in, which ranks
    pinned it. Evicted from every tier it stays registered (it loads again on demand)."""

    adapter_id: int = -1
    ranks: dict[int, set[str]] = field(default_factory=dict)
    pinned: set[int] = field(default_factory=set)

    def tiers_of(self, world_size: int) -> list[frozenset[str]]:
        return [frozenset(self.ranks.get(rank, ())) for rank in range(world_size)]


class EngineView:
    """One engine's adapters per rank and tier, pins, KV index, incarnation, weight loads and
    event counters, from its snapshot and events; running and waiting requests per adapter
    from its stats."""

    def __init__(
        self,
        engine_index: int = 0,
        incarnation: int = 0,
        lora: LoRAShape | None = None,
        kv_block_size: int | None = None,
    ) -> None:
        self._reset(engine_index, incarnation, lora, kv_block_size)

    def _reset(
        self,
        engine_index: int,
        incarnation: int,
        lora: LoRAShape | None,
        kv_block_size: int | None,
    ) -> None:
        self.engine_index = engine_index
        self.incarnation = incarnation
        self.engine_seq = -1  # the last event applied
        self.lora = lora
        self.adapters: dict[str, AdapterView] = {}
        self.lora_events: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.loads: collections.deque[tuple[str, float]] = collections.deque(maxlen=LOADS_KEPT)
        self.loads_applied = 0  # every load ever applied (renderers observe the new ones)
        # Adapter ids learned from stored blocks of adapters this view does not hold.
        self.block_lora_ids: dict[str, int] = {}
        self.kv_block_size = kv_block_size
        self.kv = KVCacheIndex()
        self.totals: collections.Counter[tuple[str, str]] = collections.Counter()
        self.dropped: collections.Counter[int] = collections.Counter()
        self.weights_loaded: dict[int, dict[str, Any]] = {}
        # (rank, layer) -> tokens routed to each expert (index) in this incarnation.
        self.expert_tokens: dict[tuple[int, int], list[int]] = {}
        # Types this process could not decode (a newer engine's): counted, not engine state.
        self.skipped: collections.Counter[str] = collections.Counter()
        # From the engine's stats: requests per adapter that run (parked included) and wait,
        # and the engine-clock time either set last changed.
        self.running: dict[str, int] = {}
        self.waiting: dict[str, int] = {}
        self.requests_changed_at = 0.0

    # ---- inputs ----

    def apply(self, n: Notification) -> None:
        """One event, through its type's handler; every event counts in the totals."""
        self.engine_seq = max(self.engine_seq, n.engine_seq)
        key = n.key if isinstance(n, CustomNotification) else ""
        self.totals[(notification_type(n), key)] += 1
        lora_key = lora_event_key(n)
        if lora_key is not None:
            self.lora_events[lora_key] += 1
        load = lora_load_time(n)
        if load is not None:
            self.loads.append(load)
            self.loads_applied += 1
        handler = _HANDLERS.get(type(n))
        if handler is not None:
            handler(self, n)

    def apply_unknown(self, type_name: str) -> None:
        """An event of a type this process cannot decode: counted, then skipped."""
        self.totals[(type_name, "")] += 1
        self.skipped[type_name] += 1

    def apply_snapshot(self, snapshot: EngineStateSnapshot) -> None:
        """Start over from the engine's snapshot (a first connection, or a new incarnation)."""
        self._reset(snapshot.engine_index, snapshot.incarnation, None, None)
        self.engine_seq = snapshot.engine_seq
        ledger = snapshot.notifications
        for total in ledger.totals:
            self.totals[(total.type, total.key)] = total.count
        for dropped in ledger.dropped:
            self.dropped[dropped.rank] = dropped.count
        for weights in ledger.weights_loaded:
            self.weights_loaded[weights.rank] = dict(weights.payload)
        for experts in ledger.expert_tokens:
            self.expert_tokens[(experts.rank, experts.layer)] = list(experts.tokens)
        lora = snapshot.lora
        if lora is not None:
            self.lora = LoRAShape(lora.world_size, lora.max_loras, lora.max_cpu_loras)
            for a in lora.adapters:
                adapter = AdapterView(a.id)
                for held in a.ranks:
                    adapter.ranks.setdefault(held.rank, set()).add(held.tier)
                adapter.pinned = set(a.pinned_ranks)
                self.adapters[a.name] = adapter
            for c in lora.events:
                self.lora_events[(c.adapter, c.event, c.reason)] = c.count
            self.loads.extend((load.transition, load.seconds) for load in lora.loads)
            self.loads_applied = len(self.loads)
        if snapshot.kv_cache is not None:
            self.kv_block_size = snapshot.kv_cache.block_size
            self.kv = KVCacheIndex.from_state(snapshot.kv_cache)

    def record_requests(
        self, running: dict[str, int], waiting: dict[str, int], changed_at: float
    ) -> None:
        """The engine's stats: requests per adapter, and when those sets last changed."""
        self.running, self.waiting, self.requests_changed_at = running, waiting, changed_at

    # ---- handlers (one per event type, in _HANDLERS) ----

    def _held(self, n: LoRAAdapterLoaded | LoRAAdapterActivated) -> None:
        adapter = self.adapters.setdefault(n.adapter_name, AdapterView())
        adapter.adapter_id = n.adapter_id
        adapter.ranks.setdefault(n.rank, set()).add(n.tier)

    def _evicted(self, n: LoRAAdapterEvicted) -> None:
        adapter = self.adapters.get(n.adapter_name)
        if adapter is None:
            return
        tiers = adapter.ranks.get(n.rank, set())
        tiers.discard(n.tier)
        if n.tier == "cpu":
            tiers.clear()  # the host tier holds everything: nothing is left on the rank
            adapter.pinned.discard(n.rank)
        if not tiers:
            adapter.ranks.pop(n.rank, None)
        if n.reason in ("unload", "load_failed") and not adapter.ranks:  # the engine forgot it
            del self.adapters[n.adapter_name]

    def _pinned(self, n: LoRAAdapterPinned) -> None:
        adapter = self.adapters.get(n.adapter_name)
        if adapter is not None:
            adapter.pinned.add(n.rank)

    def _unpinned(self, n: LoRAAdapterUnpinned) -> None:
        adapter = self.adapters.get(n.adapter_name)
        if adapter is not None:
            adapter.pinned.discard(n.rank)

    def _load_failed(self, n: LoRAAdapterLoadFailed) -> None:
        """Nothing the rank held changed (the engine's eviction with "load_failed" follows)."""

    def _kv(self, n: KVBlocksStored | KVBlocksRemoved | KVCacheCleared) -> None:
        self.kv.apply(n)
        if isinstance(n, KVBlocksStored) and n.lora_name is not None:
            self.block_lora_ids[n.lora_name] = n.lora_id

    def _dropped(self, n: NotificationsDropped) -> None:
        self.dropped[n.rank] += n.count

    def _custom(self, n: CustomNotification) -> None:
        if n.key == WEIGHTS_LOADED_KEY:
            self.weights_loaded[n.rank] = dict(n.payload)
        elif n.key == EXPERT_LOAD_KEY:
            for layer, tokens in read_expert_load(n.payload) or ():
                add_counts(self.expert_tokens.setdefault((n.rank, layer), []), tokens)

    # ---- reading ----

    def adapter_id(self, name: str) -> int | None:
        """The engine's registration id of an adapter (block names include it)."""
        adapter = self.adapters.get(name)
        if adapter is not None and adapter.adapter_id >= 0:
            return adapter.adapter_id
        return self.block_lora_ids.get(name)

    def world_size(self, adapter: AdapterView) -> int:
        if self.lora is not None:
            return self.lora.world_size
        return max(adapter.ranks, default=-1) + 1

    def tier_on(self, name: str) -> str | None:
        """Where a request on `name` finds it: "device" when every rank holds it in a device
        slot, "cpu" when every rank holds it at least in its host tier, None otherwise
        (partial residency means some rank must load it)."""
        adapter = self.adapters.get(name)
        if adapter is None:
            return None
        held = adapter.tiers_of(self.world_size(adapter))
        if held and all("device" in tiers for tiers in held):
            return "device"
        if held and all(held):
            return "cpu"
        return None

    def partial(self, name: str) -> bool:
        """Whether the ranks disagree on where the adapter is, or on its pin."""
        adapter = self.adapters.get(name)
        if adapter is None:
            return False
        world = self.world_size(adapter)
        return len(set(adapter.tiers_of(world))) > 1 or 0 < len(adapter.pinned) < world

    def pinned_in_device(self) -> list[str]:
        """Adapters pinned on some rank and held in some rank's device slot, in name order."""
        return sorted(
            name
            for name, a in self.adapters.items()
            if a.pinned and any("device" in tiers for tiers in a.ranks.values())
        )

    def state(self) -> EngineStateSnapshot:
        """The catch-up snapshot: everything above but the stats and the skipped types."""
        lora = None
        if self.lora is not None:
            lora = LoRAState(
                world_size=self.lora.world_size,
                max_loras=self.lora.max_loras,
                max_cpu_loras=self.lora.max_cpu_loras,
                adapters=[
                    AdapterResidency(
                        name,
                        a.adapter_id,
                        bool(a.pinned),
                        [
                            RankTier(rank, tier)
                            for rank in sorted(a.ranks)
                            for tier in ordered_tiers(a.ranks[rank])
                        ],
                        sorted(a.pinned),
                    )
                    for name, a in sorted(self.adapters.items())
                ],
                events=[
                    LoRAEventCount(n, e, r, c) for (n, e, r), c in sorted(self.lora_events.items())
                ],
                loads=[LoRALoadTime(t, seconds) for t, seconds in self.loads],
            )
        return EngineStateSnapshot(
            self.engine_index,
            self.engine_seq,
            NotificationLedgerState(
                totals=[NotificationTotal(t, k, c) for (t, k), c in sorted(self.totals.items())],
                dropped=[RankCount(rank, c) for rank, c in sorted(self.dropped.items())],
                weights_loaded=[
                    RankWeightsLoaded(rank, p) for rank, p in sorted(self.weights_loaded.items())
                ],
                expert_tokens=[
                    RankExpertTokens(rank, layer, list(tokens))
                    for (rank, layer), tokens in sorted(self.expert_tokens.items())
                ],
            ),
            lora=lora,
            kv_cache=None if self.kv_block_size is None else self.kv.state(self.kv_block_size),
            incarnation=self.incarnation,
        )

    def as_json(self) -> dict[str, Any]:
        """The view as the page and `/v1/engine_views` show it (the Rust server's is the same):
        named fields, adapters with their ranks, the KV index as counts, not blocks."""
        lora: dict[str, Any] | None = None
        if self.lora is not None:
            lora = {
                "world_size": self.lora.world_size,
                "max_loras": self.lora.max_loras,
                "max_cpu_loras": self.lora.max_cpu_loras,
                "adapters": [
                    {
                        "name": name,
                        "id": a.adapter_id,
                        "ranks": [
                            {
                                "rank": rank,
                                "tiers": ordered_tiers(a.ranks.get(rank, set())),
                                "pinned": rank in a.pinned,
                            }
                            for rank in sorted(set(a.ranks) | a.pinned)
                        ],
                        "tier": self.tier_on(name),
                        "partial": self.partial(name),
                        "running_requests": self.running.get(name, 0),
                        "waiting_requests": self.waiting.get(name, 0),
                    }
                    for name, a in sorted(self.adapters.items())
                ],
                "events": [
                    {"adapter": n, "event": e, "reason": r, "count": c}
                    for (n, e, r), c in sorted(self.lora_events.items())
                ],
                "last_load": (
                    {"transition": self.loads[-1][0], "seconds": self.loads[-1][1]}
                    if self.loads
                    else None
                ),
                "running": dict(sorted(self.running.items())),
                "waiting": dict(sorted(self.waiting.items())),
            }
        return {
            "engine": self.engine_index,
            "incarnation": self.incarnation,
            "engine_seq": self.engine_seq,
            "notifications": {
                "totals": [
                    {"type": t, "key": k, "count": c} for (t, k), c in sorted(self.totals.items())
                ],
                "dropped": [{"rank": r, "count": c} for r, c in sorted(self.dropped.items())],
                "weights_loaded": [
                    {"rank": r, "payload": p} for r, p in sorted(self.weights_loaded.items())
                ],
            },
            # Tokens per expert of each rank's MoE layers: the page's heat map.
            "experts": [
                {"rank": rank, "layer": layer, "tokens": tokens}
                for (rank, layer), tokens in sorted(self.expert_tokens.items())
            ],
            "lora": lora,
            "kv_cache": None
            if self.kv_block_size is None
            else {
                "block_size": self.kv_block_size,
                "blocks": len(self.kv.blocks),
                "prefixes": self.kv.roots,
            },
        }


def add_counts(into: list[int], counts: list[int]) -> None:
    """Add `counts` to `into` place by place, `into` growing to the longer of the two."""
    into.extend([0] * (len(counts) - len(into)))
    for i, count in enumerate(counts):
        into[i] += count


_HANDLERS: dict[type[Notification], Callable[[EngineView, Any], None]] = {
    LoRAAdapterLoaded: EngineView._held,
    LoRAAdapterActivated: EngineView._held,
    LoRAAdapterEvicted: EngineView._evicted,
    LoRAAdapterPinned: EngineView._pinned,
    LoRAAdapterUnpinned: EngineView._unpinned,
    LoRAAdapterLoadFailed: EngineView._load_failed,
    KVBlocksStored: EngineView._kv,
    KVBlocksRemoved: EngineView._kv,
    KVCacheCleared: EngineView._kv,
    NotificationsDropped: EngineView._dropped,
    CustomNotification: EngineView._custom,
}
