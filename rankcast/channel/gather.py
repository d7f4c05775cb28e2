"""The engine core's half of the notification channel: gather from every rank, hold, flush.

While the engine steps, every rank's events come back on its step reply (each rank drains its
buffer as it ends the step), so a busy channel costs no call of its own. Otherwise gathering
is one `take_notifications` collective over every rank, and it happens only when there is a
reason: once at start (load-time events), after a utility that changes producer state, when an
idle engine finds a rank's doorbell rung, and on the optional poll interval. A quiet channel
therefore costs no RPC at all. What was gathered waits in a bounded pending list
until the next message leaves the engine; `flush` stamps each event with its gap-free
`engine_seq`, records it in the ledger that late API servers catch up from, and encodes it once
for every API server.
"""

from __future__ import annotations

import collections
import enum
import logging
import time
from collections.abc import Callable
from typing import Protocol

import msgspec

from rankcast.channel.events import Notification, NotificationsDropped, WorkerNotification
from rankcast.config import NotificationConfig

logger = logging.getLogger(__name__)

# How often an idle engine core looks at the doorbell: cheap (a shared-memory read), and it
# bounds how long an event published while no request runs waits to leave.
DOORBELL_IDLE_CHECK_S = 0.02
ENGINE_RANK = -1


class Moment(enum.Enum):
    """The engine core's moments at which rule 5 may gather (see `collect`)."""

    START = "start"  # the serving loop starts: each rank's load-time events
    UTILITY = "utility"  # a utility that can change what a producer publishes just ran
    STEP = "step"  # a step ran: its replies carried each rank's events
    IDLE = "idle"  # no step ran: the doorbell, and the poll


class GatherError(RuntimeError):
    """A rank failed while its notifications were gathered: the engine cannot go on without
    losing events silently, so this is fatal wherever it surfaces (even inside a utility)."""


class Ranks(Protocol):
    """What the channel needs of the engine's ranks (the executor provides it): the doorbell's
    state and one drain of every rank, in rank order. A failed rank raises."""

    def notifications_pending(self) -> bool: ...

    def take_notifications(self) -> list[list[WorkerNotification] | None]: ...


class EngineNotificationChannel:
    def __init__(
        self,
        executor: Ranks,
        engine_index: int,
        tensor_parallel_size: int,
        config: NotificationConfig,
    ) -> None:
        self.executor = executor
        self.engine_index = engine_index
        self.tp_size = tensor_parallel_size
        self.capacity = config.engine_notification_buffer_size
        self.poll_interval = config.poll_interval
        self.use_doorbell = config.worker_notification_doorbell
        self.pending: collections.deque[Notification] = collections.deque()
        self.dropped = 0
        self.next_engine_seq = 0
        self.last_gather = time.monotonic()
        self.gathers = 0
        self.gather_seconds = 0.0
        # Called with each notification as it leaves (the engine core's view, whose state is
        # the catch-up snapshot); never to change the engine's own state.
        self.observers: list[Callable[[Notification], None]] = []
        self.encoder = msgspec.msgpack.Encoder()

    # ---- gathering ----

    def gather(self) -> int:
        """Drain every rank now (one collective); returns how many events arrived. A failed
        rank raises `GatherError`, and no stale reply is left for the next call."""
        start = time.perf_counter()
        self.last_gather = time.monotonic()
        # This gather drains whatever rang so far; only a ring from now on means more.
        self.executor.notifications_pending()
        try:
            batches = self.executor.take_notifications()
        except Exception as exc:  # whatever a rank's failure raised, the gather is lost
            raise GatherError(f"notification gather failed: {exc}") from exc
        arrived = self.receive(batches)
        self.gathers += 1
        self.gather_seconds += time.perf_counter() - start
        return arrived

    def receive(self, batches: list[list[WorkerNotification] | None]) -> int:
        """Rule 4 (gather): hold one drained batch per rank, from a gather or from a step's
        replies, concatenated in rank order keeping each rank's order, each event stamped with
        its source (engine, dp, pp, tp rank); returns how many there were."""
        arrived = 0
        for rank, batch in enumerate(batches):
            if not batch:
                continue
            pp_rank, tp_rank = divmod(rank, self.tp_size)
            for n in batch:
                n.engine_index = n.dp_rank = self.engine_index
                n.pp_rank, n.tp_rank, n.rank = pp_rank, tp_rank, rank
                self._hold(n)
            arrived += len(batch)
        return arrived

    def publish_engine_event(self, n: Notification) -> None:
        """Rule 10 (engine-level producers): hold an event the engine core itself produced
        (KV-cache events): source `engine_core` (rank -1), then the same sequence, flush and
        broadcast as every rank's events."""
        n.timestamp = n.timestamp or time.time()
        n.engine_index = n.dp_rank = self.engine_index
        n.rank = ENGINE_RANK
        self._hold(n)

    def _hold(self, n: Notification) -> None:
        if len(self.pending) >= self.capacity:
            self.pending.popleft()
            self.dropped += 1
        self.pending.append(n)

    def poll_due(self, now: float | None = None) -> bool:
        if self.poll_interval is None:
            return False
        return (now or time.monotonic()) - self.last_gather >= self.poll_interval

    def collect(self, moment: Moment) -> int:
        """Rule 5 (when): decide at each of the engine core's moments whether to gather every
        rank now; returns how many events arrived.

        At start (load-time events) and after a producer utility, always. After a step only
        when the poll is due: each rank's events came back on its step reply (`receive`), and
        what it published since rides the next step, or the doorbell's gather once the engine
        goes idle. Idle: when a rank rang its doorbell, or the poll is due. Nothing else costs
        an RPC.
        """
        return self.gather() if self.should_gather(moment) else 0

    def should_gather(self, moment: Moment) -> bool:
        """Rule 5's decision alone (a rung doorbell is forgotten once read: the caller must
        then collect what it rang for, as `collect` does)."""
        if moment is Moment.START or moment is Moment.UTILITY:
            return True
        return self.poll_due() or (
            moment is Moment.IDLE and self.use_doorbell and self.executor.notifications_pending()
        )

    def idle_wait(self, longest: float) -> float:
        """How long an idle engine may wait for input before it must look again."""
        wait = min(longest, DOORBELL_IDLE_CHECK_S) if self.use_doorbell else longest
        if self.poll_interval is not None:
            until_poll = self.poll_interval - (time.monotonic() - self.last_gather)
            wait = min(wait, max(0.0, until_poll))
        return wait

    # ---- flushing and catch-up ----

    def flush(self) -> list[msgspec.Raw] | None:
        """Rule 6 (flush): everything pending, the engine's own drop marker first, stamped with
        a gap-free `engine_seq`, applied to the engine's view (rule 8) and encoded once for
        every API server; None when nothing is. The engine core sends it with its next message."""
        if not self.pending and not self.dropped:
            return None
        items = list(self.pending)
        self.pending.clear()
        if self.dropped:
            marker = NotificationsDropped(
                count=self.dropped,
                timestamp=time.time(),
                engine_index=self.engine_index,
                dp_rank=self.engine_index,
                rank=ENGINE_RANK,
            )
            logger.warning("engine notification list overflowed; %d events dropped", self.dropped)
            items.insert(0, marker)
            self.dropped = 0
        raws = []
        for n in items:
            n.engine_seq = self.next_engine_seq
            self.next_engine_seq += 1
            for observe in self.observers:
                observe(n)
            raws.append(msgspec.Raw(self.encoder.encode(n)))
        return raws
