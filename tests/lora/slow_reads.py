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


class DroppedReadEvents:
    """Fault injection: right after this rank publishes that it read an adapter into its host
    tier, publish one more event, so a one-slot buffer drops the read's event (the only way
    to lose that event at a chosen moment)."""

    def drop_read_events(self) -> None:
        from rankcast.channel import CustomNotification, LoRAAdapterLoaded

        manager = self.loras  # type: ignore[attr-defined]
        publish = manager.publish

        def publish_then_push_out(n: Any) -> None:
            publish(n)
            if isinstance(n, LoRAAdapterLoaded) and n.tier == "cpu":
                publish(CustomNotification(key="test.push_out", payload={}))

        manager.publish = publish_then_push_out
