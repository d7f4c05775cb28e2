"""vllm-router (PyPI, the vLLM project's Rust router) in its own virtualenv under the cache
dir, never a dependency of rankcast: found there, or installed there once, or absent (tests
skip saying why)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.routing.kv_stream import wait_for

VERSION = "0.1.17"


def router_dir() -> Path:
    default = Path.home() / ".cache" / "rankcast-vllm-router"
    return Path(os.environ.get("VLLM_ROUTER_DIR", default))


def find_or_install() -> tuple[Path | None, str]:
    """The router's executable, or None and why not."""
    directory = router_dir()
    executable = directory / "bin" / "vllm-router"
    if executable.exists():
        return executable, ""
    try:
        subprocess.run([sys.executable, "-m", "venv", str(directory)], check=True, timeout=120)
        subprocess.run(
            [str(directory / "bin" / "pip"), "install", "-q", f"vllm-router=={VERSION}"],
            check=True,
            timeout=600,
            capture_output=True,
        )
    except (subprocess.SubprocessError, OSError) as exc:
        return None, f"vllm-router {VERSION} could not be installed into {directory}: {exc}"
    return (executable, "") if executable.exists() else (None, f"no {executable}")


def lookups(metrics_url: str) -> dict[str, float]:
    """`vllm_router_kv_placement_lookups_total` by result (hit, miss, ...)."""
    text = httpx.get(metrics_url, timeout=10).text
    found = re.findall(r'vllm_router_kv_placement_lookups_total\{result="(\w+)"\} (\S+)', text)
    return {result: float(value) for result, value in found}


@contextlib.contextmanager
def running_router(executable: Path, args: list[str], port: int, log: Path) -> Iterator[str]:
    """The router on `port`, its output in `log`; always stopped, its whole session."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(executable), "--host", "127.0.0.1", "--port", str(port), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            assert proc.poll() is None, f"vllm-router exited: {log.read_text()[-2000:]}"
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"{url}/readiness", timeout=2).status_code == 200
            return False

        wait_for(ready, "vllm-router to be ready", 60)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
