"""The launcher's restart rule for the processes it starts, and the state file that tells API
servers what it knows.

A dead engine core is started again (with its ranks) under the next incarnation number, after
a back-off that grows with its recent failures (1 s, 2 s, 4 s; RANKCAST_RESTART_BACKOFF_S sets
other waits); a dead API server at once, then after 1 s and 2 s. Three failures (deaths or
failed starts) of one process within five minutes and the launcher stops trying: a given-up
engine stays dead, its API servers answer 503, and `/health` says why. The rule is the same
whether the process died while starting or while serving (`fleet.py` watches both).

The launcher writes its view to a small JSON file the API servers read
(`rankcast/supervisor_state.py`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from rankcast import envs
from rankcast.supervisor_state import EngineState

logger = logging.getLogger(__name__)

RESTART_BACKOFF_S = (1.0, 2.0, 4.0)
# An API server holds no model: the first restart is immediate.
API_SERVER_BACKOFF_S = (0.0, 1.0, 2.0)
GIVE_UP_FAILURES = 3
GIVE_UP_WINDOW_S = 300.0


@dataclass
class Supervision:
    """The restart bookkeeping of one supervised process (an engine core, an API server)."""

    role: str  # how messages name it: "engine core 0", "API server 1"
    index: int
    backoff_s: tuple[float, ...] = RESTART_BACKOFF_S
    incarnation: int = 0  # starts so far, less one
    failures: list[float] = field(default_factory=list)  # monotonic times, within the window
    retry_at: float | None = None  # set while a restart is due: when to try
    given_up: str | None = None
    last_failure: str = ""  # why it last died or failed to start
    ever_ready: bool = False
    recovering: bool = False  # failed, and not ready since
    # Engine cores' starts are incarnations users see (event ids, /health); API servers' not.
    names_incarnations: bool = True

    @classmethod
    def engine(cls, dp: int) -> Supervision:
        return cls(f"engine core {dp}", dp, envs.restart_backoff_s() or RESTART_BACKOFF_S)

    @classmethod
    def api_server(cls, index: int) -> Supervision:
        return cls(f"API server {index}", index, API_SERVER_BACKOFF_S, names_incarnations=False)

    def failed(self, why: str, now: float | None = None) -> None:
        """Count a death or a failed start; schedule the next try, or give up."""
        now = time.monotonic() if now is None else now
        self.last_failure = why
        self.recovering = True
        self.failures = [t for t in self.failures if now - t < GIVE_UP_WINDOW_S] + [now]
        if len(self.failures) >= GIVE_UP_FAILURES:
            self.given_up = (
                f"{self.role} failed {len(self.failures)} times within "
                f"{GIVE_UP_WINDOW_S:.0f} s (last: {why}); the launcher does not restart it"
            )
            self.retry_at = None
            logger.error("%s", self.given_up)
            return
        delay = self.backoff_s[min(len(self.failures), len(self.backoff_s)) - 1]
        self.retry_at = now + delay
        which = f" (incarnation {self.incarnation + 1})" if self.names_incarnations else ""
        logger.error("%s: %s; starting it again in %g s%s", self.role, why, delay, which)

    def due(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return self.retry_at is not None and now >= self.retry_at

    def restarting(self) -> None:
        """A restart begins: the next incarnation is starting."""
        self.incarnation += 1
        self.retry_at = None

    def ready(self) -> None:
        """The process in this place reported ready."""
        if self.recovering:
            which = f" (incarnation {self.incarnation})" if self.names_incarnations else ""
            logger.info("%s is serving again%s", self.role, which)
        self.ever_ready = True
        self.recovering = False

    def state(self) -> EngineState:
        if self.given_up is not None:
            return EngineState(
                engine=self.index,
                incarnation=self.incarnation,
                state="given_up",
                message=self.given_up,
            )
        if self.recovering:
            # While the restart waits out its back-off, the incarnation to come is the next.
            coming = self.incarnation + (1 if self.retry_at is not None else 0)
            return EngineState(
                engine=self.index,
                incarnation=self.incarnation,
                state="restarting",
                message=f"{self.role} is being restarted "
                f"(incarnation {coming}) after it {self.last_failure}",
            )
        if not self.ever_ready:
            return EngineState(
                engine=self.index,
                incarnation=self.incarnation,
                state="starting",
                message=f"{self.role} is starting",
            )
        return EngineState(engine=self.index, incarnation=self.incarnation, state="serving")
