"""KV-cache events in vLLM's wire format, for the routers that read vLLM's (vllm-router
`kv_aware`, llm-d's KV-cache indexer, Dynamo's KV router).

What they decode is vLLM's `ZmqEventPublisher` (vllm/distributed/kv_events.py): on a PUB socket
`[topic, 8-byte big-endian seq, msgpack KVEventBatch]`, seq from 0 in every publisher process;
the batch a positional array `[ts, events, data_parallel_rank]`; each event a msgpack map whose
`type` names it (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`), fields declared without a
default always present (None when unset), the others left out when unset; a ROUTER replay
socket as `SequencedPublisher` answers; data-parallel engine i on port + i. The structs below are
declared in vLLM's field order with its names, so msgspec writes exactly those maps.

Meanings, where rankcast's engine differs from vLLM's:
- block hashes are rankcast's own chain (`kv_index.block_hash`: 63-bit, non-negative),
  opaque names to a consumer, which matches prompts by the `token_ids` a stored event carries;
- `medium` is "GPU", vLLM's name for the engine's own KV cache whatever the device: consumers
  read "CPU" as an offload tier and discount it, and this cache is the one requests run from;
- `lora_id` is the adapter's registration (None for the base model) and `lora_name` the name
  clients send as `model`, which is what consumers hash with the tokens;
- `group_idx`, left out for group 0, is 1 for the blocks of a sliding-window layers' KV-cache
  group (engine_core/kv_cache_manager.py: Gemma 3's local layers), whose blocks are handed
  back behind the window: a consumer matching prefixes reads group 0 (one that does not know
  the field ignores it, as msgspec and vLLM's own decoder do, and then sees the windowed
  group's names stored and removed beside the full group's).

The rule that keeps a consumer's index from going stale: `AllBlocksCleared` is the first event
of every engine incarnation and follows every prefix-cache reset at once, idle or not.
"""

from __future__ import annotations

import dataclasses
import time

import msgspec

from rankcast.channel.events import KVBlocksRemoved, KVBlocksStored, KVCacheCleared, KVCacheEvent
from rankcast.channel.sequenced_publisher import SequencedPublisher, endpoint_for_engine
from rankcast.config import KVEventsConfig

MEDIUM = "GPU"


class VLLMKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's `KVCacheEvent`: a map tagged `type` with the class name."""


class BlockStored(VLLMKVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None


class BlockRemoved(VLLMKVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(VLLMKVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def to_vllm(event: KVCacheEvent) -> BlockStored | BlockRemoved | AllBlocksCleared:
    """One of the engine's KV-cache events as vLLM would have published it."""
    if isinstance(event, KVBlocksStored):
        return BlockStored(
            block_hashes=event.block_hashes,
            parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_id=event.lora_id or None,
            medium=MEDIUM,
            lora_name=event.lora_name,
            group_idx=event.group_idx or None,
        )
    if isinstance(event, KVBlocksRemoved):
        return BlockRemoved(
            block_hashes=event.block_hashes, medium=MEDIUM, group_idx=event.group_idx or None
        )
    assert isinstance(event, KVCacheCleared)
    return AllBlocksCleared()


def for_engine(config: KVEventsConfig, engine_index: int) -> KVEventsConfig:
    """The publisher config of one data-parallel engine: its endpoints offset."""
    return dataclasses.replace(
        config,
        endpoint=endpoint_for_engine(config.endpoint, engine_index),
        replay_endpoint=endpoint_for_engine(config.replay_endpoint, engine_index),
    )


def engine_sources(config: KVEventsConfig | None, engines: int) -> dict[str, dict[str, object]]:
    """What `GET /kv_event_sources` answers: each engine's publisher config keyed by its
    data-parallel rank, in vLLM's shape (its `KVEventsConfig` fields), endpoints offset; {}
    when none publishes (as vLLM answers), rankcast's own stream being found in its flags
    instead. Every API server answers this, the Rust ones as the launcher hands it to them."""
    if config is None or not config.publishes:
        return {}
    return {str(rank): msgspec.to_builtins(for_engine(config, rank)) for rank in range(engines)}


class KVEventPublisher(SequencedPublisher):
    """One engine core's publisher: one batch per step that changed the cache."""

    def __init__(self, config: KVEventsConfig, engine_index: int) -> None:
        config = for_engine(config, engine_index)
        super().__init__(
            config.endpoint,
            config.replay_endpoint,
            config.topic.encode(),
            buffer_steps=config.buffer_steps,
            hwm=config.hwm,
            name="kv-event-pub",
        )
        self.engine_index = engine_index
        self.encoder = msgspec.msgpack.Encoder()

    @classmethod
    def create(cls, config: KVEventsConfig | None, engine_index: int) -> KVEventPublisher | None:
        if config is None or not config.publishes:
            return None
        return cls(config, engine_index)

    def publish_events(self, events: list[KVCacheEvent]) -> None:
        """Hand one step's events to the socket thread as one batch (called on the busy loop)."""
        batch = KVEventBatch(time.time(), [to_vllm(e) for e in events], self.engine_index)
        self.publish(self.encoder.encode(batch))
