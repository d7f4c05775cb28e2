"""The state file through which the launcher tells API servers what it knows about the fleet.

The launcher (`rankcast/launcher/supervision.py` decides restarts) writes it; every API
server's `/health` reads it (`RANKCAST_SUPERVISOR_STATE`): the only way an API server can tell
an engine that is coming back from one that is not, and a fleet still starting from one that
has started. A leaf module, because two processes share the format.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

SUPERVISOR_STATE_ENV = "RANKCAST_SUPERVISOR_STATE"


class EngineState(msgspec.Struct, kw_only=True):
    """One engine core as the launcher sees it: `starting` (its first start), `serving`,
    `restarting` or `given_up`."""

    engine: int
    incarnation: int
    state: str
    message: str = ""


class FleetState(msgspec.Struct, kw_only=True):
    """The fleet as a whole: `starting` until every engine core and every API server has been
    ready once, then `serving` for good (a later restart is one process's, not the fleet's)."""

    state: str
    api_servers: int
    api_servers_ready: int
    message: str = ""


class SupervisorState(msgspec.Struct, kw_only=True):
    """The state file's whole content: what every API server's `/health` reads."""

    fleet: FleetState
    engines: list[EngineState]


def write_state(path: Path, state: SupervisorState) -> None:
    """Replace the state file at once (a reader never sees half of it)."""
    partial = path.with_suffix(".tmp")
    partial.write_bytes(msgspec.json.encode(state))
    os.replace(partial, path)


def read_state() -> SupervisorState | None:
    """The launcher's view of the fleet; None outside `rankcast serve` or before the launcher
    wrote it."""
    path = os.environ.get(SUPERVISOR_STATE_ENV)
    if not path:
        return None
    try:
        return msgspec.json.decode(Path(path).read_bytes(), type=SupervisorState)
    except (OSError, msgspec.DecodeError):
        return None
