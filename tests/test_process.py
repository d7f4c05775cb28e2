"""TeardownSkip: a child that finished cleanly ends without the interpreter's module teardown,
after the exit hooks registered later than it and with its log flushed; any other end is the
ordinary one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CHILD = """
import atexit, logging, sys
from pathlib import Path
from rankcast.process import TeardownSkip

out = Path(sys.argv[1])
teardown = TeardownSkip()

class TornDown:
    # Runs only when the interpreter tears its modules down.
    def __del__(self):
        (out / "teardown").write_text("ran")

sys.modules["__torn_down"] = TornDown()
atexit.register(lambda: (out / "later-hook").write_text("ran"))
logging.basicConfig(filename=out / "log", level=logging.INFO)
logging.getLogger("child").info("last words")
if sys.argv[2] == "finished":
    teardown.finished()
elif sys.argv[2] == "failed":
    raise SystemExit(3)
"""


@pytest.mark.parametrize("end", ["finished", "unfinished", "failed"])
def test_only_a_finished_process_skips_the_teardown(tmp_path: Path, end: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path), end], capture_output=True, timeout=60
    )
    assert result.returncode == (3 if end == "failed" else 0), result.stderr
    assert (tmp_path / "later-hook").read_text() == "ran"
    assert "last words" in (tmp_path / "log").read_text()
    assert (tmp_path / "teardown").exists() == (end != "finished")
