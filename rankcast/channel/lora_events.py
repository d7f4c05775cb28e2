"""What the LoRA lifecycle events mean to their consumers: the labels of the event counter and
of the load-time histogram. The engine's registry (for the catch-up snapshot) and every API
server's metrics count by the same keys, so they agree.
"""

from __future__ import annotations

from rankcast.channel.events import (
    LORA_TYPES,
    LoRAAdapterActivated,
    LoRAAdapterEvicted,
    LoRAAdapterLoaded,
    Notification,
    notification_type,
)


def lora_event_name(n: Notification) -> str | None:
    """ "loaded", "activated", "evicted", ... for a LoRA lifecycle event; None for other types."""
    if not isinstance(n, LORA_TYPES):
        return None
    return notification_type(n).removeprefix("lora_adapter_")


def lora_event_key(n: Notification) -> tuple[str, str, str] | None:
    """(adapter, event, reason) of a LoRA lifecycle event, the labels of its event counter;
    None for other types. The engine's snapshot and every API server count by this key."""
    event = lora_event_name(n)
    if event is None:
        return None
    reason = n.reason if isinstance(n, LoRAAdapterEvicted) else ""
    return n.adapter_name, event, reason  # type: ignore[attr-defined]


def lora_load_time(n: Notification) -> tuple[str, float] | None:
    """(transition, seconds) when the event is a timed move into a tier; None otherwise."""
    if isinstance(n, LoRAAdapterLoaded | LoRAAdapterActivated):
        return load_transition(n), n.seconds
    return None


def load_transition(n: LoRAAdapterLoaded | LoRAAdapterActivated) -> str:
    """The `transition` label of `vllm:lora_adapter_load_seconds`: disk_to_cpu or cpu_to_gpu
    (vLLM's metric names call the device tier "gpu" whatever the device is)."""
    if isinstance(n, LoRAAdapterActivated):
        return "cpu_to_gpu"
    return f"disk_to_{'gpu' if n.tier == 'device' else n.tier}"
