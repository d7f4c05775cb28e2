"""What an API server knows about LoRA adapter residency: built only from the engine's
lifecycle notifications and its catch-up snapshot, so every API server agrees without asking
the engine per request."""

from __future__ import annotations

from typing import Any

from rankcast.notifications import LoRAAdapterEvicted, LoRAAdapterLoaded, Notification
from rankcast.protocol import EngineStateSnapshot


class LoRAResidency:
    """Per engine, per adapter: the ranks that hold it and in which tier (a NotificationSink)."""

    def __init__(self) -> None:
        # engine -> adapter name -> rank -> tier
        self.resident: dict[int, dict[str, dict[int, str]]] = {}
        self.world_size: dict[int, int] = {}

    def apply_snapshot(self, snapshot: EngineStateSnapshot) -> None:
        section: dict[str, Any] = snapshot.sections.get("lora", {})
        engine = snapshot.engine_index
        self.world_size[engine] = int(section.get("world_size", 1))
        self.resident[engine] = {
            a["name"]: {int(rank): tier for rank, tier in a["ranks"]}
            for a in section.get("adapters", [])
        }

    def consume(self, notifications: list[Notification], unknown: list[str], now: float) -> None:
        for n in notifications:
            if isinstance(n, LoRAAdapterLoaded):
                adapters = self.resident.setdefault(n.engine_index, {})
                adapters.setdefault(n.adapter_name, {})[n.rank] = n.tier
            elif isinstance(n, LoRAAdapterEvicted):
                ranks = self.resident.get(n.engine_index, {}).get(n.adapter_name)
                if ranks is not None:
                    ranks.pop(n.rank, None)
                    if not ranks:
                        del self.resident[n.engine_index][n.adapter_name]

    def names(self) -> list[str]:
        """Adapters some engine holds, in name order."""
        return sorted({name for adapters in self.resident.values() for name in adapters})

    def describe(self) -> list[dict[str, Any]]:
        """`/v1/lora_adapters`: per adapter, its residency per engine and rank; `partial` when
        some rank of an engine that has it does not."""
        out = []
        for name in self.names():
            engines = []
            partial = False
            for engine, adapters in sorted(self.resident.items()):
                ranks = adapters.get(name)
                if ranks is None:
                    continue
                world = self.world_size.get(engine, len(ranks))
                partial = partial or len(ranks) < world
                engines.append(
                    {
                        "engine": engine,
                        "ranks": [{"rank": r, "tier": t} for r, t in sorted(ranks.items())],
                    }
                )
            out.append({"name": name, "engines": engines, "partial": partial})
        return out
