"""`LoRARequest`: which adapter an offline request uses."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name and the PEFT directory it is loaded from (once, on first use)."""

    name: str
    path: str
