"""A worker rank's notification buffer: where producers inside the rank publish (rules 1-3 of
the notification channel, docs/architecture.md).

`publish_worker_notification(n)` validates `n` at once (so a bad payload fails at the producer,
never in the engine), stamps a per-buffer `seq` and the time, and queues it in the buffer of the
worker it runs for; the engine core drains each rank's buffer with `Worker.take_notifications`.

Each worker owns its buffer. A producer finds it without holding the worker: during any call
the executor makes into a worker, that worker's buffer is the current one (a context variable);
outside one (a plugin's own thread) the process's only live worker is meant, which is every
rank process's case. Where one process holds several workers (two in-process engines) a thread
of its own must capture `current_notification_buffer()` during a call and publish through it;
guessing would put one engine's events into the other's stream.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import logging
import math
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import msgspec

from rankcast.notifications import (
    MAX_NOTIFICATION_BYTES,
    WORKER_TYPES,
    CustomNotification,
    Notification,
    NotificationsDropped,
    WorkerNotification,
)

logger = logging.getLogger(__name__)

DEFAULT_BUFFER_SIZE = 1024


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


_SCALARS = frozenset({str, bool, bytes, type(None)})


def _is_plain(value: Any) -> bool:
    """The common case, fast: exact builtin types only, no paths kept. A False sends the
    value through `_check_value`, which names what is wrong (or accepts a subclass)."""
    kind = type(value)
    if kind in _SCALARS:
        return True
    if kind is int:
        return bool(-(2**63) <= value < 2**64)
    if kind is float:
        return math.isfinite(value)
    # Plain loops: a third faster than all() over a generator, on every publish.
    if kind is dict:
        for key, item in value.items():  # noqa: SIM110
            if type(key) is not str or not _is_plain(item):
                return False
        return True
    if kind is list or kind is tuple:
        for item in value:  # noqa: SIM110
            if not _is_plain(item):
                return False
        return True
    return False


def validate_notification(n: Any) -> int:
    """Check a notification before it is queued; return its encoded size."""
    if type(n) not in WORKER_TYPES:
        names = ", ".join(t.__name__ for t in WORKER_TYPES)
        raise TypeError(
            f"publish_worker_notification takes one of {names} (plugins use CustomNotification "
            f"with their own key), got {type(n).__name__}"
        )
    if isinstance(n, CustomNotification):
        if not isinstance(n.key, str) or not n.key:
            raise TypeError(f"notification key must be a non-empty str, got {n.key!r}")
        if not isinstance(n.payload, dict):
            raise TypeError(f"payload: must be a dict, got {type(n.payload).__name__}")
        if not _is_plain(n.payload):
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

    def clear(self, rank: int) -> None:
        """The rank drained its own buffer (into a step's reply): nothing left to gather."""
        self.flags[rank] = 0

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
    """A bounded FIFO of validated notifications; full means the oldest is dropped and counted.

    `doorbell` and `rank`: the shared-memory flag this buffer rings when it goes non-empty.
    """

    def __init__(
        self, capacity: int = DEFAULT_BUFFER_SIZE, doorbell: Doorbell | None = None, rank: int = 0
    ) -> None:
        if capacity < 1:
            raise ValueError(f"notification buffer size must be >= 1, got {capacity}")
        self._lock = threading.Lock()
        self._items: collections.deque[Notification] = collections.deque()
        self._capacity = capacity
        self._seq = 0
        self._dropped = 0
        self._last_dropped_seq = 0
        self._warned = False
        self._doorbell = doorbell
        self._rank = rank

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
        if self._doorbell is not None:
            self._doorbell.ring(self._rank)
        if warn:
            logger.warning(
                "worker notification buffer is full (%d); dropping the oldest events "
                "(counted in rankcast:worker_notifications_dropped_total; warned once)",
                self._capacity,
            )

    @property
    def pending(self) -> bool:
        return bool(self._items) or self._dropped > 0

    def take(self) -> list[WorkerNotification] | None:
        """Everything queued, oldest first, with a drop marker at the head; None when empty."""
        if not self._items and not self._dropped:
            return None
        with self._lock:
            items: list[Notification] = list(self._items)
            self._items.clear()
            dropped, self._dropped = self._dropped, 0
            last_lost = self._last_dropped_seq
            # Under the lock: a publish after this drain rings again after this clear.
            if self._doorbell is not None:
                self._doorbell.clear(self._rank)
        if dropped:
            marker = NotificationsDropped(count=dropped, seq=last_lost, timestamp=time.time())
            items.insert(0, marker)
        return items or None  # type: ignore[return-value]

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """Make this the buffer `publish_worker_notification` uses, for the calls inside."""
        token = _current.set(self)
        try:
            yield
        finally:
            _current.reset(token)

    def register(self) -> None:
        """Count this buffer among the process's live workers' (see the module docstring)."""
        _live[:] = [ref for ref in _live if ref() is not None] + [weakref.ref(self)]

    def unregister(self) -> None:
        _live[:] = [ref for ref in _live if ref() not in (None, self)]


# Which buffer a producer means: the one of the worker call in progress, else the only live one.
_current: contextvars.ContextVar[NotificationBuffer | None] = contextvars.ContextVar(
    "rankcast_worker_notification_buffer", default=None
)
# Weak references, so an engine dropped without shutdown does not count; a list, so the common
# case (one worker in the process) costs one lookup per publish.
_live: list[weakref.ref[NotificationBuffer]] = []


def current_notification_buffer() -> NotificationBuffer:
    """The buffer of the worker this code runs for; raises when that cannot be told."""
    buffer = _current.get()
    if buffer is not None:
        return buffer
    if len(_live) == 1:
        only = _live[0]()
        if only is not None:
            return only
    live = [b for b in (ref() for ref in _live) if b is not None]
    if len(live) == 1:
        return live[0]
    if not live:
        raise RuntimeError(
            "publish_worker_notification was called outside a worker rank: this process has "
            "no worker, so there is no notification buffer to publish into"
        )
    raise RuntimeError(
        f"publish_worker_notification was called outside a worker call in a process with "
        f"{len(live)} workers (several in-process engines): capture "
        "current_notification_buffer() during a worker call and publish through it"
    )


def publish_worker_notification(n: Notification) -> None:
    """Queue `n` for the engine core; raises TypeError/ValueError naming what is wrong with it."""
    current_notification_buffer().publish(n)
