"""The engine notification channel: everything its contract is, in one package.

Events published in any worker rank are gathered by the engine core from every rank and
broadcast to every API server, in the same order. The modules, in the order an event meets
them (docs/architecture.md has the rules and the one function that carries out each):

    events.py       the wire types: the tagged union of notifications, the stream's batch
                    (imports nothing of rankcast's)
    validation.py   rule 1: a payload is checked where it is published
    buffer.py       rules 1-3: each worker's bounded buffer, `publish`, the drain
    doorbell.py     rule 5: how an idle engine core learns that a rank published
    gather.py       rules 4-6, 10: the engine core's gather, pending list, sequence and flush
    view.py         rule 8: the engine's state as its events describe it (`EngineView`): the
                    engine core's catch-up snapshot, and every API server's view of each engine
    snapshot.py     the snapshot's declared structs (what `EngineView.state()` returns)
    kv_index.py     block naming and the prefix-cache index the KV-cache events describe
    stream.py       the ZMQ event stream for machines (PUB, replay, snapshot)
    vllm_kv_events.py  rule 12: KV-cache events in vLLM's wire format, for vLLM's consumers
    sequenced_publisher.py  the socket layer of both streams (seq from 0, replay, first hold)
    decoder.py      rule 9: how a consumer reads a batch, skipping types it does not know
    lora_events.py  what the LoRA lifecycle events mean to their counters (the view's keys)
    expert_load.py  what the ranks' expert-load events carry (tokens routed to each expert)

A producer needs one import:

    from rankcast.channel import CustomNotification, publish

    publish(CustomNotification(key="myplugin.cache_warmed", payload={"entries": 4096}))

Nothing here imports the worker, the executor or the engine, so every process can use it.
"""

from __future__ import annotations

from rankcast.channel.buffer import NotificationBuffer, current_notification_buffer, publish
from rankcast.channel.events import (
    MAX_NOTIFICATION_BYTES,
    AnyNotification,
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
    WorkerNotification,
    notification_type,
)

__all__ = [
    "MAX_NOTIFICATION_BYTES",
    "AnyNotification",
    "CustomNotification",
    "KVBlocksRemoved",
    "KVBlocksStored",
    "KVCacheCleared",
    "LoRAAdapterActivated",
    "LoRAAdapterEvicted",
    "LoRAAdapterLoadFailed",
    "LoRAAdapterLoaded",
    "LoRAAdapterPinned",
    "LoRAAdapterUnpinned",
    "Notification",
    "NotificationBuffer",
    "NotificationsDropped",
    "WorkerNotification",
    "current_notification_buffer",
    "notification_type",
    "publish",
]
