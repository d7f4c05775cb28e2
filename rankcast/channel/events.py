"""The engine notification channel's wire types: what a rank or the engine core publishes and
every API server receives.

Notifications are a msgspec tagged union encoded as maps with a `"type"` tag, so a frontend that
meets a type it does not know can read the tag, count it and skip it. The rest of this package
is where they are published (`buffer.py`), gathered, sequenced and flushed (`gather.py`),
streamed to machines (`stream.py`) and decoded by consumers (`decoder.py`);
docs/architecture.md has the rules and the function that carries out each. This module imports
nothing of rankcast's, so every process's code (and `rankcast/protocol.py`) can use it.
"""

from __future__ import annotations

from typing import Any

import msgspec

# Encoded size bound for one notification: an event is a fact, not a payload transport.
MAX_NOTIFICATION_BYTES = 64 * 1024
# The key of the in-tree producer that reports each rank's weight-load time.
WEIGHTS_LOADED_KEY = "rankcast.weights_loaded"


class Notification(msgspec.Struct, tag_field="type", kw_only=True, omit_defaults=True):
    """Fields every notification carries; all are stamped by the channel, never by producers.

    `seq` counts notifications published by one worker process (gaps show where drops were);
    `engine_seq` counts what one engine core gathered, gap-free, and names the event in
    `/v1/events` as `engine:engine_seq`. The source fields are set at gather, by the engine core,
    from the rank that returned the event.
    """

    seq: int = 0
    timestamp: float = 0.0
    engine_seq: int = -1
    engine_index: int = -1
    dp_rank: int = -1
    pp_rank: int = -1
    tp_rank: int = -1
    rank: int = -1


class CustomNotification(Notification, tag="custom"):
    """The open hatch: any producer's event, named by a dotted `key`.

    Consumers act on the keys they know and skip the others.
    """

    key: str
    payload: dict[str, Any] = msgspec.field(default_factory=dict)


class NotificationsDropped(Notification, tag="notifications_dropped"):
    """`count` events were lost before this point; `seq` is the last lost one's sequence number.

    From a worker: its buffer overflowed. With `rank` -1: the engine core's pending list did.
    """

    count: int


class LoRAAdapterLoaded(Notification, tag="lora_adapter_loaded"):
    """A rank read an adapter from disk into `tier` ("cpu": its host tier) in `seconds`.

    `adapter_id` is the engine's id for the adapter, stable while it stays registered.
    """

    adapter_name: str
    adapter_id: int
    tier: str
    seconds: float


class LoRAAdapterActivated(Notification, tag="lora_adapter_activated"):
    """A rank copied a host-tier adapter into device `slot` in `seconds`; requests may use it."""

    adapter_name: str
    adapter_id: int
    tier: str
    seconds: float
    slot: int


class LoRAAdapterEvicted(Notification, tag="lora_adapter_evicted"):
    """A rank dropped an adapter from `tier` ("device", "cpu"; "disk" for the unload of one
    held in no tier, so consumers forget it).

    `reason`: "lru" (its device slot went to another adapter), "capacity" (the host tier was
    full), "unload" (a user unloaded it), "load_failed" (a rank could not read it; the engine
    dropped it). After "unload" and "load_failed" the adapter is no longer registered.
    """

    adapter_name: str
    adapter_id: int
    tier: str
    reason: str


class LoRAAdapterPinned(Notification, tag="lora_adapter_pinned"):
    """A rank pinned an adapter: it stays in the device tier until unpinned or unloaded."""

    adapter_name: str
    adapter_id: int
    tier: str


class LoRAAdapterUnpinned(Notification, tag="lora_adapter_unpinned"):
    """A rank unpinned an adapter: it may be evicted again (least recently used first)."""

    adapter_name: str
    adapter_id: int
    tier: str


class LoRAAdapterLoadFailed(Notification, tag="lora_adapter_load_failed"):
    """A rank could not load an adapter; nothing it held changed."""

    adapter_name: str
    error: str
    adapter_id: int = -1


LoRAEvent = (
    LoRAAdapterLoaded
    | LoRAAdapterActivated
    | LoRAAdapterEvicted
    | LoRAAdapterPinned
    | LoRAAdapterUnpinned
    | LoRAAdapterLoadFailed
)


class KVBlocksStored(Notification, tag="kv_blocks_stored"):
    """The engine cached full blocks of one sequence, in order: `block_hashes[i]` names block i,
    whose `block_size` tokens are `token_ids[i * block_size:(i + 1) * block_size]`; each name is
    chained to the one before it, the first to `parent_block_hash` (None at a sequence's start).
    `lora_id` is the adapter registration that computed them (0: the base model), so equal tokens
    under another adapter are other blocks. A subscriber that applies every stored and removed
    event in order holds exactly the engine's cache index."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int = 0
    lora_name: str | None = None
    # The KV-cache group the blocks are in (engine_core/kv_cache_manager.py): 0, the full
    # attention layers' (or a model's only group); 1, the sliding-window layers' of a model
    # that has both, which hands blocks back behind the window. A prefix index matches on
    # group 0.
    group_idx: int = 0


class KVBlocksRemoved(Notification, tag="kv_blocks_removed"):
    """The engine reused the memory of these cached blocks of KV-cache group `group_idx`: their
    K/V is gone there."""

    block_hashes: list[int]
    group_idx: int = 0


class KVCacheCleared(Notification, tag="kv_cache_cleared"):
    """Every cached block was forgotten at once (the prefix cache was reset)."""


KVCacheEvent = KVBlocksStored | KVBlocksRemoved | KVCacheCleared
WorkerNotification = CustomNotification | NotificationsDropped | LoRAEvent
# Everything a frontend may receive: what ranks publish, and the engine core's own events.
AnyNotification = WorkerNotification | KVCacheEvent
LORA_TYPES = (
    LoRAAdapterLoaded,
    LoRAAdapterActivated,
    LoRAAdapterEvicted,
    LoRAAdapterPinned,
    LoRAAdapterUnpinned,
    LoRAAdapterLoadFailed,
)
# What a worker may publish (KV-cache events are the engine core's own).
WORKER_TYPES = (CustomNotification, NotificationsDropped, *LORA_TYPES)


def notification_type(n: Notification) -> str:
    """The wire tag of a notification ("custom", "lora_adapter_loaded", ...)."""
    return n.__struct_config__.tag  # type: ignore[return-value]


class NotificationBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    """One frame's payload on the ZMQ event stream: the events one flush sent, in order."""

    timestamp: float
    engine_index: int
    notifications: list[msgspec.Raw]
