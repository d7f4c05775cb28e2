"""Build and locate the Rust workspace's binaries (`rust/`) for the tests that run them.

`make test` builds the workspace (release) before the Python suite; building again here is a
no-op then, and makes a lone `pytest` run work too. Release, as the launcher runs it: a debug
build here was a second whole build inside the suite's time (30 s on a clean CI clone), and
its API server spent several times the CPU per token. Cargo runs offline against Debian's
packaged crates.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

WORKSPACE = Path(__file__).resolve().parent.parent / "rust"


def cargo() -> str:
    found = shutil.which("cargo") or str(Path.home() / ".cargo" / "bin" / "cargo")
    assert os.access(found, os.X_OK), "the Rust side needs cargo (make test installs the rest)"
    return found


def binary(name: str) -> Path:
    """The release build of binary `name`, built first if it is missing or stale."""
    result = subprocess.run(
        [cargo(), "build", "--offline", "--quiet", "--release", "--bin", name],
        cwd=WORKSPACE,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"cargo build --bin {name} failed:\n{result.stderr}"
    path = WORKSPACE / "target" / "release" / name
    assert path.exists(), path
    return path
