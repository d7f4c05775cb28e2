"""The entry point of a spawned worker rank, in a module that imports nothing heavy.

A spawned child first imports the module its target lives in; were the target
`worker_proc.run_worker` itself, torch would be imported there, before this process could pause
the garbage collector for it (rankcast/startup_gc.py: ~0.3 s of torch's import). The launcher's
children enter the same way (rankcast/launcher/children.py).
"""

from __future__ import annotations

from typing import Any

from rankcast.startup_gc import collector_paused


def rank_process(*args: Any) -> None:
    """`rankcast.worker.worker_proc.run_worker` (one worker rank) in this process; the rank
    registers its own TeardownSkip."""
    with collector_paused():
        from rankcast.worker.worker_proc import run_worker

    run_worker(*args)
