"""The launcher's supervision of engine cores: restart a dead one, back off, give up.

A dead engine core is started again (with its ranks) under the next incarnation number, after a
back-off that grows with its recent failures (1 s, 2 s, 4 s). Three failures (deaths or failed
starts) within five minutes and the launcher stops trying: the engine stays dead, its API
servers answer 503, and `/health` says why. The launcher writes each engine's state to a small
JSON file the API servers read (`RANKCAST_SUPERVISOR_STATE`), the only way they can tell an
engine that is coming back from one that is not.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

logger = logging.getLogger(__name__)

SUPERVISOR_STATE_ENV = "RANKCAST_SUPERVISOR_STATE"
RESTART_BACKOFF_S = (1.0, 2.0, 4.0)
GIVE_UP_FAILURES = 3
GIVE_UP_WINDOW_S = 300.0


class EngineState(msgspec.Struct, kw_only=True):
    """One engine core as the launcher sees it: `serving`, `restarting` or `given_up`."""

    engine: int
    incarnation: int
    state: str
    message: str = ""


@dataclass
class EngineSupervision:
    """The restart bookkeeping of one engine core."""

    engine: int
    incarnation: int = 0
    failures: list[float] = field(default_factory=list)  # monotonic times, within the window
    retry_at: float | None = None  # set while a restart is due: when to try
    given_up: str | None = None
    last_failure: str = ""  # why it last died or failed to start

    def failed(self, why: str, now: float | None = None) -> None:
        """Count a death or a failed start; schedule the next try, or give up."""
        now = time.monotonic() if now is None else now
        self.last_failure = why
        self.failures = [t for t in self.failures if now - t < GIVE_UP_WINDOW_S] + [now]
        if len(self.failures) >= GIVE_UP_FAILURES:
            self.given_up = (
                f"engine core {self.engine} failed {len(self.failures)} times within "
                f"{GIVE_UP_WINDOW_S:.0f} s (last: {why}); the launcher does not restart it"
            )
            self.retry_at = None
            logger.error("%s", self.given_up)
            return
        delay = RESTART_BACKOFF_S[min(len(self.failures), len(RESTART_BACKOFF_S)) - 1]
        self.retry_at = now + delay
        logger.error(
            "engine core %d: %s; starting it again in %.0f s (incarnation %d)",
            self.engine,
            why,
            delay,
            self.incarnation + 1,
        )

    def due(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return self.retry_at is not None and now >= self.retry_at

    def state(self) -> EngineState:
        if self.given_up is not None:
            return EngineState(
                engine=self.engine,
                incarnation=self.incarnation,
                state="given_up",
                message=self.given_up,
            )
        if self.retry_at is not None:
            return EngineState(
                engine=self.engine,
                incarnation=self.incarnation,
                state="restarting",
                message=f"engine core {self.engine} is being restarted "
                f"(incarnation {self.incarnation + 1}) after it {self.last_failure}",
            )
        return EngineState(engine=self.engine, incarnation=self.incarnation, state="serving")


def write_states(path: Path, engines: list[EngineSupervision]) -> None:
    """Replace the state file at once (a reader never sees half of it)."""
    partial = path.with_suffix(".tmp")
    partial.write_bytes(msgspec.json.encode([e.state() for e in engines]))
    os.replace(partial, path)


def read_states() -> dict[int, EngineState]:
    """The launcher's view of every engine core; empty outside `rankcast serve` or before the
    launcher wrote it."""
    path = os.environ.get(SUPERVISOR_STATE_ENV)
    if not path:
        return {}
    try:
        states = msgspec.json.decode(Path(path).read_bytes(), type=list[EngineState])
    except (OSError, msgspec.DecodeError):
        return {}
    return {s.engine: s for s in states}
