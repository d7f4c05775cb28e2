"""`rankcast chat`, as `make serve` runs it until the HTTP server exists."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _rankcast(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rankcast.launcher.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_chat_answers_paris() -> None:
    result = _rankcast("chat", "What is the capital of France?", "--kv-cache-space", "0.25")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_chat_with_missing_model_is_a_one_line_error(tmp_path: Path) -> None:
    missing = tmp_path / "absent.gguf"
    result = _rankcast("chat", "hi", "--model", str(missing))
    assert result.returncode == 2
    assert f"{missing}: model path not found" in result.stderr
    assert "Traceback" not in result.stderr
