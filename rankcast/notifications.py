"""The engine notification channel's events, and the worker-side buffer they are published into.

A producer inside a worker rank calls `publish_worker_notification(n)` from any thread. The
notification is validated at once (so a bad payload fails at the producer, never in the engine),
stamped with a per-process `seq` and a timestamp, and queued in this process's bounded buffer —
the one piece of process-global state rankcast keeps, because a producer (a plugin thread, an
adapter manager) must be able to publish without holding a reference to the worker. The engine
core drains every rank's buffer with `take_notifications` and stamps each event with where it
came from.

Notifications are a msgspec tagged union encoded as maps with a `"type"` tag, so a frontend that
meets a type it does not know can read the tag, count it and skip it.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from typing import Any

import msgspec

logger = logging.getLogger(__name__)

DEFAULT_BUFFER_SIZE = 1024
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


class KVBlocksRemoved(Notification, tag="kv_blocks_removed"):
    """The engine reused the memory of these cached blocks: their K/V is gone."""

    block_hashes: list[int]


class KVCacheCleared(Notification, tag="kv_cache_cleared"):
    """Every cached block was forgotten at once (the prefix cache was reset)."""


KVCacheEvent = KVBlocksStored | KVBlocksRemoved | KVCacheCleared
WorkerNotification = CustomNotification | NotificationsDropped | LoRAEvent
# Everything a frontend may receive: what ranks publish, and the engine core's own events.
AnyNotification = WorkerNotification | KVCacheEvent
_LORA_TYPES = (
    LoRAAdapterLoaded,
    LoRAAdapterActivated,
    LoRAAdapterEvicted,
    LoRAAdapterPinned,
    LoRAAdapterUnpinned,
    LoRAAdapterLoadFailed,
)
_WORKER_TYPES = (CustomNotification, NotificationsDropped, *_LORA_TYPES)


def lora_event_name(n: Notification) -> str | None:
    """ "loaded", "activated", "evicted", ... for a LoRA lifecycle event; None for other types."""
    if not isinstance(n, _LORA_TYPES):
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


def notification_type(n: Notification) -> str:
    """The wire tag of a notification ("custom", "lora_adapter_loaded", ...)."""
    return n.__struct_config__.tag  # type: ignore[return-value]


class _TypeOnly(msgspec.Struct):
    """Just the tag, to name a notification type this process does not know."""

    type: str = "?"


class NotificationDecoder:
    """Decodes notifications one by one, so one unknown type never spoils a batch."""

    def __init__(self) -> None:
        self._decoder = msgspec.msgpack.Decoder(AnyNotification)
        self._tag_decoder = msgspec.msgpack.Decoder(_TypeOnly)

    def decode(self, raws: list[msgspec.Raw]) -> tuple[list[Notification], list[str]]:
        """The notifications this process knows, and the type names of those it skipped."""
        known: list[Notification] = []
        unknown: list[str] = []
        for raw in raws:
            try:
                known.append(self._decoder.decode(raw))
            except msgspec.DecodeError:  # includes ValidationError: an unknown tag
                try:
                    unknown.append(self._tag_decoder.decode(raw).type)
                except msgspec.DecodeError:
                    unknown.append("?")
        return known, unknown


# ---- validation ----


def _check_value(value: Any, path: str) -> None:
    """Raise naming `path` unless `value` is plain msgpack data (what every consumer can read)."""
    if value is None or isinstance(value, bool | str | bytes):
        return
    if isinstance(value, int):
        if not -(2**63) <= value < 2**64:
            raise ValueError(f"{path}: integer {value} does not fit in 64 bits")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{path}: {value} is not a finite number (JSON consumers reject it)")
        return
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_value(item, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{path}: key {key!r} is {type(key).__name__}, keys must be str")
            _check_value(item, f"{path}[{key!r}]")
        return
    raise TypeError(f"{path}: {type(value).__name__} is not msgpack-encodable plain data")


def validate_notification(n: Any) -> int:
    """Check a notification before it is queued; return its encoded size."""
    if type(n) not in _WORKER_TYPES:
        names = ", ".join(t.__name__ for t in _WORKER_TYPES)
        raise TypeError(
            f"publish_worker_notification takes one of {names} (plugins use CustomNotification "
            f"with their own key), got {type(n).__name__}"
        )
    if isinstance(n, CustomNotification):
        if not isinstance(n.key, str) or not n.key:
            raise TypeError(f"notification key must be a non-empty str, got {n.key!r}")
        if not isinstance(n.payload, dict):
            raise TypeError(f"payload: must be a dict, got {type(n.payload).__name__}")
        _check_value(n.payload, "payload")
    size = len(msgspec.msgpack.encode(n))
    if size > MAX_NOTIFICATION_BYTES:
        raise ValueError(
            f"notification {getattr(n, 'key', type(n).__name__)!r} is {size} bytes encoded; "
            f"the limit is {MAX_NOTIFICATION_BYTES}"
        )
    return size


# ---- the doorbell and the buffer ----


class Doorbell:
    """One byte per rank in shared memory: publish sets its rank's byte, the engine core reads
    and clears them after a step, so a quiet channel costs no RPC and no system call.

    Built by the executor (`multiprocessing` shared memory travels to spawned ranks as an
    argument); the in-process executor uses one for its single rank the same way.
    """

    def __init__(self, flags: Any) -> None:
        self.flags = flags

    @classmethod
    def create(cls, num_ranks: int, context: Any = None) -> Doorbell:
        import multiprocessing

        ctx = context or multiprocessing.get_context("spawn")
        return cls(ctx.RawArray("b", num_ranks))

    def ring(self, rank: int) -> None:
        self.flags[rank] = 1

    def take(self) -> bool:
        """True if any rank rang since the last take; clears them first, so a ring that lands
        during the gather that follows is seen next time rather than lost."""
        flags = self.flags
        if not any(flags):
            return False
        for i in range(len(flags)):
            flags[i] = 0
        return True


class NotificationBuffer:
    """A bounded FIFO of validated notifications; full means the oldest is dropped and counted."""

    def __init__(self, capacity: int = DEFAULT_BUFFER_SIZE) -> None:
        self._lock = threading.Lock()
        self._items: collections.deque[Notification] = collections.deque()
        self._capacity = capacity
        self._seq = 0
        self._dropped = 0
        self._last_dropped_seq = 0
        self._warned = False
        self._doorbell: Doorbell | None = None
        self._rank = 0

    def configure(self, capacity: int, doorbell: Doorbell | None = None, rank: int = 0) -> None:
        """Set the bound and the doorbell this process rings (called once at worker start)."""
        if capacity < 1:
            raise ValueError(f"notification buffer size must be >= 1, got {capacity}")
        with self._lock:
            self._capacity = capacity
            self._doorbell = doorbell
            self._rank = rank
            while len(self._items) > capacity:
                self._drop_oldest()

    def _drop_oldest(self) -> None:
        lost = self._items.popleft()
        self._dropped += 1
        self._last_dropped_seq = lost.seq

    def publish(self, n: Notification) -> None:
        validate_notification(n)
        with self._lock:
            self._seq += 1
            n.seq = self._seq
            n.timestamp = time.time()
            if len(self._items) >= self._capacity:
                self._drop_oldest()
                warn = not self._warned
                self._warned = True
            else:
                warn = False
            self._items.append(n)
            doorbell = self._doorbell
        if doorbell is not None:
            doorbell.ring(self._rank)
        if warn:
            logger.warning(
                "worker notification buffer is full (%d); dropping the oldest events "
                "(counted in rankcast:worker_notifications_dropped_total; warned once)",
                self._capacity,
            )

    @property
    def pending(self) -> bool:
        return bool(self._items) or self._dropped > 0

    def take(self) -> list[Notification] | None:
        """Everything queued, oldest first, with a drop marker at the head; None when empty."""
        if not self._items and not self._dropped:
            return None
        with self._lock:
            items = list(self._items)
            self._items.clear()
            dropped, self._dropped = self._dropped, 0
            last_lost = self._last_dropped_seq
        if dropped:
            marker = NotificationsDropped(count=dropped, seq=last_lost, timestamp=time.time())
            items.insert(0, marker)
        return items or None


# The worker process's buffer (see the module docstring for why it is global).
_buffer = NotificationBuffer()


def worker_notification_buffer() -> NotificationBuffer:
    return _buffer


def publish_worker_notification(n: Notification) -> None:
    """Queue `n` for the engine core; raises TypeError/ValueError naming what is wrong with it."""
    _buffer.publish(n)


class NotificationBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    """One frame's payload on the ZMQ event stream: the events one flush sent, in order."""

    timestamp: float
    engine_index: int
    notifications: list[msgspec.Raw]
