"""The channel's ledger: what has left one engine core so far, so a late or restarted API server
starts its counters from the same totals as its siblings (rule 8, the snapshot's
`notifications` section)."""

from __future__ import annotations

import collections
from typing import Any

from rankcast.channel.events import (
    WEIGHTS_LOADED_KEY,
    CustomNotification,
    Notification,
    NotificationsDropped,
    notification_type,
)
from rankcast.channel.snapshot import (
    NotificationLedgerState,
    NotificationTotal,
    RankCount,
    RankWeightsLoaded,
)


class NotificationLedger:
    """What has left this engine so far, kept so a late API server can start from the totals:
    counts per (type, key), drops per rank, and each rank's last weight-load figure."""

    def __init__(self) -> None:
        self.totals: collections.Counter[tuple[str, str]] = collections.Counter()
        self.dropped: collections.Counter[int] = collections.Counter()
        self.weights_loaded: dict[int, dict[str, Any]] = {}

    def record(self, n: Notification) -> None:
        key = n.key if isinstance(n, CustomNotification) else ""
        self.totals[(notification_type(n), key)] += 1
        if isinstance(n, NotificationsDropped):
            self.dropped[n.rank] += n.count
        elif isinstance(n, CustomNotification) and n.key == WEIGHTS_LOADED_KEY:
            self.weights_loaded[n.rank] = dict(n.payload)

    def state(self) -> NotificationLedgerState:
        return NotificationLedgerState(
            totals=[NotificationTotal(t, k, c) for (t, k), c in sorted(self.totals.items())],
            dropped=[RankCount(rank, c) for rank, c in sorted(self.dropped.items())],
            weights_loaded=[
                RankWeightsLoaded(rank, p) for rank, p in sorted(self.weights_loaded.items())
            ],
        )
