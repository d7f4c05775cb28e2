"""Which LoRA adapters the engine serves and which slot each holds on every rank.

The engine core owns this, not an API server, so adapters added through any API server (or the
offline `LLM`) are the same for all. An adapter is validated here, in full, before any rank is
touched: a bad one changes nothing.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rankcast.config import LoRAConfig
from rankcast.executor.base import Executor
from rankcast.lora.peft_adapter import load_peft_adapter
from rankcast.model.arch import ArchConfig
from rankcast.notifications import (
    LoRAAdapterEvicted,
    LoRAAdapterLoaded,
    LoRAAdapterLoadFailed,
    Notification,
)

# Load-time observations kept for a late API server's histogram (oldest forgotten first).
_LOADS_KEPT = 10_000


@dataclass(frozen=True)
class RegisteredAdapter:
    name: str
    path: str
    slot: int
    rank: int
    nbytes: int


class LoRARegistry:
    def __init__(
        self,
        executor: Executor,
        arch: ArchConfig,
        config: LoRAConfig,
        requests_using: Callable[[int], int],
    ) -> None:
        self.executor = executor
        self.arch = arch
        self.config = config
        self.requests_using = requests_using
        self.adapters: dict[str, RegisteredAdapter] = {}
        roots = config.allowed_lora_paths
        self.allowed_roots = None if roots is None else [Path(r) for r in roots]
        self.events: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.loads: collections.deque[tuple[str, float]] = collections.deque(maxlen=_LOADS_KEPT)

    def observe(self, n: Notification) -> None:
        """Count lifecycle events as they leave the engine (for the catch-up snapshot)."""
        if isinstance(n, LoRAAdapterLoaded):
            self.events[(n.adapter_name, "loaded", "")] += 1
            self.loads.append((f"disk_to_{n.tier}", n.seconds))
        elif isinstance(n, LoRAAdapterEvicted):
            self.events[(n.adapter_name, "evicted", n.reason)] += 1
        elif isinstance(n, LoRAAdapterLoadFailed):
            self.events[(n.adapter_name, "load_failed", "")] += 1

    def name_of(self, slot: int) -> str | None:
        return next((a.name for a in self.adapters.values() if a.slot == slot), None)

    def add(self, name: str, path: str) -> dict[str, Any]:
        """Validate, then load into a free slot on every rank (same name and path: a no-op)."""
        if not name:
            raise ValueError("an adapter needs a name")
        known = self.adapters.get(name)
        adapter = load_peft_adapter(
            name, path, self.arch, self.config.max_lora_rank, self.allowed_roots
        )
        if known is not None:
            if known.path == str(adapter.path):
                return self._describe(known)
            raise ValueError(f"adapter {name!r} is already loaded from {known.path}")
        used = {a.slot for a in self.adapters.values()}
        free = [slot for slot in range(self.config.max_loras) if slot not in used]
        if not free:
            raise ValueError(
                f"all {self.config.max_loras} adapter slots (--max-loras) are in use; "
                "unload one first"
            )
        self.executor.collective_rpc("add_lora", (free[0], name, str(adapter.path)))
        entry = RegisteredAdapter(name, str(adapter.path), free[0], adapter.rank, adapter.nbytes)
        self.adapters[name] = entry
        return self._describe(entry)

    def remove(self, name: str) -> None:
        entry = self._entry(name)
        busy = self.requests_using(entry.slot)
        if busy:
            raise ValueError(f"adapter {name!r} is in use by {busy} request(s)")
        self.executor.collective_rpc("remove_lora", (entry.slot, name))
        del self.adapters[name]

    def slot_of(self, name: str) -> int:
        return self._entry(name).slot

    def _entry(self, name: str) -> RegisteredAdapter:
        entry = self.adapters.get(name)
        if entry is None:
            known = ", ".join(sorted(self.adapters)) or "none"
            raise ValueError(f"unknown LoRA adapter {name!r} (loaded: {known})")
        return entry

    def list(self) -> list[dict[str, Any]]:
        return [self._describe(a) for a in sorted(self.adapters.values(), key=lambda a: a.slot)]

    @staticmethod
    def _describe(entry: RegisteredAdapter) -> dict[str, Any]:
        return {
            "name": entry.name,
            "path": entry.path,
            "slot": entry.slot,
            "rank": entry.rank,
            "bytes": entry.nbytes,
        }
