"""Which `rankcast-frontend` the launcher runs: a build older than the Rust sources speaks an
older wire, so it is never picked; the release build is preferred to the debug one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rankcast.launcher import rust_api_server


def _executable(path: Path, mtime: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    os.utime(path, (mtime, mtime))


def test_a_build_older_than_its_sources_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rust_api_server, "_WORKSPACE", tmp_path)
    monkeypatch.delenv(rust_api_server.BINARY_ENV, raising=False)
    source = tmp_path / "wire" / "src" / "lib.rs"
    source.parent.mkdir(parents=True)
    source.write_text("// the wire\n")
    os.utime(source, (2000.0, 2000.0))
    release = tmp_path / "target" / "release" / "rankcast-frontend"
    debug = tmp_path / "target" / "debug" / "rankcast-frontend"
    _executable(release, 1000.0)
    assert rust_api_server.frontend_binary() is None, "a stale release build must not run"
    _executable(debug, 3000.0)
    assert rust_api_server.frontend_binary() == debug
    os.utime(release, (4000.0, 4000.0))
    assert rust_api_server.frontend_binary() == release
    monkeypatch.setenv(rust_api_server.BINARY_ENV, str(debug))
    assert rust_api_server.frontend_binary() == debug, "the environment names the build"
