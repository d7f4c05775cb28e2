"""The entry points of the processes the launcher starts, in a module that imports nothing heavy
(a rank's is rankcast/worker/rank_entry.py, for the same reasons).

A spawned child first imports the module its target lives in. Were the targets the functions
in `engine_core/core_proc.py` or `openai/api_server.py` themselves, the launcher would have to
import those (torch; FastAPI and uvicorn) to name them, and an engine core would import the API
server's modules too, since the launcher's module did: ~0.8 s each, before the child could start
its real work. Here each child imports only what it runs, with the garbage collector paused
(rankcast/startup_gc.py: ~0.3 s of torch's import). Each also registers its TeardownSkip
before those imports (rankcast/process.py), so a clean stop ends without the module teardown.
"""

from __future__ import annotations

import signal
from typing import Any

from rankcast.process import TeardownSkip
from rankcast.startup_gc import collector_paused


def _leave_ctrl_c_to_the_launcher() -> None:
    """Ctrl-C reaches the whole process group, children still importing or loading included:
    the launcher stops each in order (SIGTERM), so a child ignores SIGINT from its first line
    instead of dying in a traceback of whatever it was importing. A serving API server's
    uvicorn takes SIGINT again, for its drain."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def engine_core_process(*args: Any) -> None:
    """`rankcast.engine_core.core_proc.run_engine_core` in this process."""
    _leave_ctrl_c_to_the_launcher()
    teardown = TeardownSkip()
    with collector_paused():
        from rankcast.engine_core.core_proc import run_engine_core

    run_engine_core(*args)
    teardown.finished()


def api_server_process(*args: Any) -> None:
    """`rankcast.api_server.app.run_api_server` in this process."""
    _leave_ctrl_c_to_the_launcher()
    teardown = TeardownSkip()
    with collector_paused():
        from rankcast.api_server.app import run_api_server

    run_api_server(*args)
    teardown.finished()
