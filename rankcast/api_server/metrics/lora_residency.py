"""What an API server knows about LoRA adapters: built only from the engine's lifecycle
notifications, its catch-up snapshot and its scheduler stats, so every API server agrees without
asking the engine per request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rankcast.channel.events import (
    LoRAAdapterActivated,
    LoRAAdapterEvicted,
    LoRAAdapterLoaded,
    LoRAAdapterPinned,
    LoRAAdapterUnpinned,
    Notification,
)
from rankcast.channel.snapshot import EngineStateSnapshot
from rankcast.protocol import SchedulerStats

# Tier order in replies: the device first, as the one requests run on.
_TIER_ORDER = {"device": 0, "cpu": 1}


@dataclass
class AdapterOnEngine:
    """One registered adapter on one engine: the tiers each rank holds it in, and which ranks
    pinned it. A registered adapter evicted from every tier stays (it loads again on demand)."""

    ranks: dict[int, set[str]] = field(default_factory=dict)
    pinned: set[int] = field(default_factory=set)


class LoRAResidency:
    """Per engine, per adapter, per rank: tiers and pins (a NotificationSink)."""

    def __init__(self) -> None:
        self.adapters: dict[int, dict[str, AdapterOnEngine]] = {}
        self.world_size: dict[int, int] = {}
        self.max_loras = 0
        self.running: dict[int, dict[str, int]] = {}
        self.waiting: dict[int, dict[str, int]] = {}
        self.changed_at: dict[int, float] = {}

    # ---- inputs ----

    def apply_snapshot(self, snapshot: EngineStateSnapshot) -> None:
        lora = snapshot.lora
        if lora is None:
            return
        engine = snapshot.engine_index
        self.world_size[engine] = lora.world_size
        self.max_loras = max(self.max_loras, lora.max_loras)
        adapters: dict[str, AdapterOnEngine] = {}
        for a in lora.adapters:
            state = AdapterOnEngine()
            for held in a.ranks:
                state.ranks.setdefault(held.rank, set()).add(held.tier)
            if a.pinned:
                state.pinned = set(state.ranks)
            adapters[a.name] = state
        self.adapters[engine] = adapters

    def consume(self, notifications: list[Notification], unknown: list[str], now: float) -> None:
        for n in notifications:
            if isinstance(n, LoRAAdapterLoaded | LoRAAdapterActivated):
                state = self._state(n.engine_index, n.adapter_name, create=True)
                assert state is not None
                state.ranks.setdefault(n.rank, set()).add(n.tier)
            elif isinstance(n, LoRAAdapterEvicted):
                self._evicted(n)
            elif isinstance(n, LoRAAdapterPinned | LoRAAdapterUnpinned):
                state = self._state(n.engine_index, n.adapter_name)
                if state is not None:
                    if isinstance(n, LoRAAdapterPinned):
                        state.pinned.add(n.rank)
                    else:
                        state.pinned.discard(n.rank)

    def _evicted(self, n: LoRAAdapterEvicted) -> None:
        state = self._state(n.engine_index, n.adapter_name)
        if state is None:
            return
        tiers = state.ranks.get(n.rank, set())
        tiers.discard(n.tier)
        if n.tier == "cpu":
            tiers.clear()  # the host tier is a superset: nothing of it is left on the rank
            state.pinned.discard(n.rank)
        if not tiers:
            state.ranks.pop(n.rank, None)
        if n.reason in ("unload", "load_failed") and not state.ranks:  # the engine forgot it
            del self.adapters[n.engine_index][n.adapter_name]

    def _state(self, engine: int, name: str, create: bool = False) -> AdapterOnEngine | None:
        adapters = self.adapters.setdefault(engine, {})
        if create and name not in adapters:
            adapters[name] = AdapterOnEngine()
        return adapters.get(name)

    def record_scheduler_stats(self, engine_index: int, stats: SchedulerStats) -> None:
        self.running[engine_index] = stats.running_lora_requests
        self.waiting[engine_index] = stats.waiting_lora_requests
        self.changed_at[engine_index] = stats.lora_requests_changed_at

    @property
    def requests_changed_at(self) -> float:
        """When some engine's running or waiting adapter set last changed (engine clock)."""
        return max(self.changed_at.values(), default=0.0)

    # ---- views ----

    def names(self) -> list[str]:
        """Adapters some engine has registered, in name order (servable by name)."""
        return sorted({name for adapters in self.adapters.values() for name in adapters})

    def refusal(self, name: str) -> str | None:
        """Why a request on `name` could not run on any engine until someone unpins: on each
        engine that has it, every device slot holds another pinned adapter. None: it can run.
        (The engine core checks the same at submission; this gives the client a 400.)"""
        blocked: list[str] = []
        for adapters in self.adapters.values():
            if name not in adapters:
                continue
            pinned = sorted(
                other
                for other, state in adapters.items()
                if other != name
                and state.pinned
                and any("device" in t for t in state.ranks.values())
            )
            if len(pinned) < self.max_loras:
                return None
            blocked = pinned
        if not blocked:
            return None
        return (
            f"every device slot (--max-loras {self.max_loras}) holds a pinned adapter "
            f"({', '.join(blocked)}); unpin one to serve {name!r}"
        )

    def tier_on(self, engine: int, name: str) -> str | None:
        """Where a request on `name` finds it on `engine` (the router's adapter term): "device"
        when every rank holds it in a device slot, "cpu" when every rank holds it at least in
        its host tier, None otherwise (partial residency means some rank must load it)."""
        state = self.adapters.get(engine, {}).get(name)
        if state is None:
            return None
        world = self.world_size.get(engine, max(state.ranks, default=-1) + 1)
        held = [state.ranks.get(rank, set()) for rank in range(world)]
        if held and all("device" in tiers for tiers in held):
            return "device"
        if held and all(tiers for tiers in held):
            return "cpu"
        return None

    def running_adapters(self) -> list[str]:
        return sorted({a for counts in self.running.values() for a in counts})

    def waiting_adapters(self) -> list[str]:
        return sorted({a for counts in self.waiting.values() for a in counts})

    def describe(self) -> list[dict[str, Any]]:
        """`/v1/lora_adapters`: per adapter its tiers, whether pinned, residency per engine and
        rank, request counts, and `partial` when the ranks of one engine disagree."""
        out = []
        for name in self.names():
            engines, tiers, pinned, partial = [], set[str](), False, False
            for engine, adapters in sorted(self.adapters.items()):
                state = adapters.get(name)
                if state is None:
                    continue
                world = self.world_size.get(engine, max(state.ranks, default=-1) + 1)
                held = [frozenset(state.ranks.get(rank, ())) for rank in range(world)]
                partial = partial or len(set(held)) > 1 or 0 < len(state.pinned) < world
                tiers.update(*held)
                pinned = pinned or bool(state.pinned)
                engines.append(
                    {
                        "engine": engine,
                        "ranks": [
                            {
                                "rank": rank,
                                "tiers": _ordered(t),
                                "pinned": rank in state.pinned,
                            }
                            for rank, t in sorted(state.ranks.items())
                        ],
                    }
                )
            out.append(
                {
                    "name": name,
                    "tiers": _ordered(tiers),
                    "pinned": pinned,
                    "partial": partial,
                    "running_requests": sum(c.get(name, 0) for c in self.running.values()),
                    "waiting_requests": sum(c.get(name, 0) for c in self.waiting.values()),
                    "engines": engines,
                }
            )
        return out


def _ordered(tiers: set[str] | frozenset[str]) -> list[str]:
    return sorted(tiers, key=lambda t: _TIER_ORDER.get(t, len(_TIER_ORDER)))
