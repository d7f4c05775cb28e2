"""A worker rank's notification buffer: where producers inside the rank publish (rules 1-3 of
the notification channel, docs/architecture.md).

`publish(n)` validates `n` at once (`validation.py`: a bad payload fails at the producer, never
in the engine), stamps a per-buffer `seq` and the time, and queues it in the buffer of the
worker it runs for; the worker drains its buffer into each step's reply and when the engine
core gathers (`NotificationBuffer.take`).

Each worker owns its buffer. A producer finds it without holding the worker: during any call
the executor makes into a worker, that worker's buffer is the current one (a context variable);
outside one (a plugin's own thread) the process's only live worker is meant, which is every
rank process's case. Where one process holds several workers (two in-process engines) a thread
of its own must capture `current_notification_buffer()` during a call and publish through it;
guessing would put one engine's events into the other's stream. The context variable and the
list of live buffers are the process's only global state in the channel (the documented worker
buffer registry).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import logging
import threading
import time
import weakref
from collections.abc import Iterator

from rankcast.channel.doorbell import Doorbell
from rankcast.channel.events import Notification, NotificationsDropped, WorkerNotification
from rankcast.channel.validation import validate_notification

logger = logging.getLogger(__name__)

DEFAULT_BUFFER_SIZE = 1024


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
        """Make this the buffer `publish` uses, for the calls inside."""
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
            "rankcast.channel.publish was called outside a worker rank: this process has "
            "no worker, so there is no notification buffer to publish into"
        )
    raise RuntimeError(
        f"rankcast.channel.publish was called outside a worker call in a process with "
        f"{len(live)} workers (several in-process engines): capture "
        "current_notification_buffer() during a worker call and publish through it"
    )


def publish(n: Notification) -> None:
    """Rule 1: queue `n` for the engine core, from any thread of a worker process; raises
    TypeError/ValueError naming what is wrong with it, so a bad event never leaves its
    producer."""
    current_notification_buffer().publish(n)
