"""The engine's catch-up snapshot (rule 8): one declared struct per section, and the whole.

This is the state the channel's events describe, as `EngineView.state()` (`view.py`) returns it:
the engine core sends it to every API server that connects (in `EngineReady`, and on the event
stream's snapshot socket), and each starts its own view of the engine from it. Positional on
the wire like every other message (`rankcast/protocol.py`: field order is a contract; a field
list that changes bumps `PROTOCOL_VERSION`).
"""

from __future__ import annotations

from typing import Any

import msgspec


class NotificationTotal(msgspec.Struct, array_like=True):
    """How many notifications of one type (and, for `custom`, one key) have left the engine."""

    type: str
    key: str
    count: int


class RankCount(msgspec.Struct, array_like=True):
    rank: int
    count: int


class RankWeightsLoaded(msgspec.Struct, array_like=True):
    """A rank's last `rankcast.weights_loaded` payload (bytes, seconds)."""

    rank: int
    payload: dict[str, Any]


class RankExpertTokens(msgspec.Struct, array_like=True):
    """The tokens one rank's MoE layer `layer` routed to each expert, in expert order, summed
    over every `rankcast.expert_load` event of the incarnation (protocol 16)."""

    rank: int
    layer: int
    tokens: list[int]


class NotificationLedgerState(msgspec.Struct, array_like=True, omit_defaults=True):
    """The channel's own totals: what every API server's notification counters start from."""

    totals: list[NotificationTotal] = msgspec.field(default_factory=list)
    dropped: list[RankCount] = msgspec.field(default_factory=list)
    weights_loaded: list[RankWeightsLoaded] = msgspec.field(default_factory=list)
    # Per (rank, layer) in that order (protocol 16).
    expert_tokens: list[RankExpertTokens] = msgspec.field(default_factory=list)


class RankTier(msgspec.Struct, array_like=True):
    rank: int
    tier: str


class AdapterResidency(msgspec.Struct, array_like=True, omit_defaults=True):
    """Where one adapter is, rank by rank."""

    name: str
    id: int
    pinned: bool = False
    ranks: list[RankTier] = msgspec.field(default_factory=list)
    # The ranks that pinned it (protocol 12): a rank's pin moves with its own events.
    pinned_ranks: list[int] = msgspec.field(default_factory=list)


class LoRAEventCount(msgspec.Struct, array_like=True):
    """The LoRA lifecycle event counter's value for one (adapter, event, reason)."""

    adapter: str
    event: str
    reason: str
    count: int


class LoRALoadTime(msgspec.Struct, array_like=True):
    """One observation of the adapter load-time histogram."""

    transition: str
    seconds: float


class LoRAState(msgspec.Struct, array_like=True, omit_defaults=True):
    """Adapter residency per rank, the slot limits, and the event totals so far."""

    world_size: int
    max_loras: int
    max_cpu_loras: int
    adapters: list[AdapterResidency] = msgspec.field(default_factory=list)
    events: list[LoRAEventCount] = msgspec.field(default_factory=list)
    loads: list[LoRALoadTime] = msgspec.field(default_factory=list)


class KVCacheBlock(msgspec.Struct, array_like=True):
    """One cached block as the KV-cache events described it."""

    block_hash: int
    parent: int | None
    token_ids: list[int]
    lora_id: int


class KVCacheState(msgspec.Struct, array_like=True, omit_defaults=True):
    """The prefix-cache index as of the snapshot (present with --kv-events)."""

    block_size: int
    blocks: list[KVCacheBlock] = msgspec.field(default_factory=list)


class EngineStateSnapshot(msgspec.Struct, array_like=True, omit_defaults=True):
    """What a late or restarted API server needs to agree with its siblings.

    `engine_seq` is the last notification the state includes, so the stream that follows
    continues from there. `lora` is present when the engine serves adapters, `kv_cache` when it
    publishes KV-cache events. `incarnation` counts the engine core's starts under the
    launcher (0 first; each restart after a death adds one): its `engine_seq` starts over.
    """

    engine_index: int = 0
    engine_seq: int = -1
    notifications: NotificationLedgerState = msgspec.field(default_factory=NotificationLedgerState)
    lora: LoRAState | None = None
    kv_cache: KVCacheState | None = None
    incarnation: int = 0
