"""Fault injection for the background-read test: a worker extension that makes this rank's
adapter reads from disk slow, as a cold or remote disk would (the tiny test adapters otherwise
read in a millisecond, too fast to see anything happen meanwhile)."""

from __future__ import annotations

import time
from typing import Any

import rankcast.worker.lora_manager as lora_manager


class SlowReads:
    def slow_down_reads(self, seconds: float) -> None:
        """Every adapter read on this rank takes `seconds` longer from now on."""
        read = lora_manager.load_peft_adapter

        def slow(*args: Any, **kwargs: Any) -> Any:
            time.sleep(seconds)
            return read(*args, **kwargs)

        lora_manager.load_peft_adapter = slow  # type: ignore[assignment]
