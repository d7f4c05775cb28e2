"""When `rankcast serve` exits, every process it started has been reaped: nothing of its
session is left, not even a `<defunct>` entry, at the moment the launcher's exit is seen (what
a supervisor, a container runtime or a test harness checks). Before, multiprocessing's resource
tracker (and a rank orphaned by its engine core) outlived the launcher by a moment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.entrypoints.server_process import ServerProcess, in_session, tiny_model_args


def _left_when_the_launcher_exits(server: ServerProcess, signal_group: bool) -> dict[int, str]:
    launcher = server.proc
    os.kill(-launcher.pid if signal_group else launcher.pid, signal.SIGTERM)
    assert launcher.wait(60) == 0
    return in_session(launcher.pid)


@pytest.mark.parametrize("signal_group", [True, False], ids=["group", "launcher"])
def test_no_process_of_the_session_outlives_the_launcher(
    tiny_llama_dir: Path, signal_group: bool
) -> None:
    # Ranks in processes of their own (mp), two API servers: every kind of child there is.
    server = ServerProcess(
        *tiny_model_args(tiny_llama_dir, "--tensor-parallel-size", "2"), api_server_count=2
    )
    try:
        server.wait_healthy()
        assert len(in_session(server.proc.pid)) >= 5  # launcher, engine, 2 ranks, 2 servers
        assert _left_when_the_launcher_exits(server, signal_group) == {}
    finally:
        server.kill()


def test_an_orphaned_descendant_is_adopted_and_waited_for() -> None:
    """A grandchild whose parent is gone is adopted and waited for, not left to init: the
    launcher's reaping checked on its own, with a process tree made for it."""
    script = """
import subprocess, sys
from rankcast.launcher.descendants import adopt_orphans, reap_everything
assert adopt_orphans()
grandchild = "import time; time.sleep(1)"
middle = subprocess.Popen([sys.executable, "-c",
    f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {grandchild!r}])"])
middle.wait()  # the grandchild lives on, orphaned: now this process's child
print("killed", reap_everything(timeout_s=10))
"""
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.strip() == "killed []"  # it ended on its own, and was waited for
    assert in_session(proc.pid) == {}
