"""A Rust API server (`rust/frontend`, the `rankcast-frontend` binary) as one of the launcher's
children, so that it is started, watched, restarted and stopped exactly like a Python one.

This process is a thin keeper: it starts the binary with the engine core's addresses for its
client index, reports ready to the launcher when the binary says it is serving (it binds the
shared port only after its engine handshake, as the Python servers do), passes its log lines
through, and takes the binary down with it on SIGTERM/SIGINT or when the launcher dies.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path

import msgspec

from rankcast.addresses import ClientAddresses
from rankcast.api_server.server_config import ApiServerConfig
from rankcast.channel.vllm_kv_events import engine_sources
from rankcast.process import die_with_parent, set_process_title

BINARY_ENV = "RANKCAST_RUST_FRONTEND"
_WORKSPACE = Path(__file__).resolve().parents[2] / "rust"
READY_MARK = "rankcast-frontend: serving on"


def _newest_source() -> float:
    """When the Rust sources last changed (a build older than that would speak an old wire), or
    the schema copy it embeds (rankcast/api_server/openapi_document.py)."""
    # The crates and the workspace's own files; the build output (target/) is not walked.
    tops = [p for p in _WORKSPACE.iterdir() if p.name != "target"] if _WORKSPACE.is_dir() else []
    sources = [
        path
        for top in tops
        for path in ([top] if top.is_file() else top.rglob("*"))
        if path.suffix == ".rs" or path.name in ("Cargo.toml", "Cargo.lock", "openapi.json")
    ]
    return max((path.stat().st_mtime for path in sources), default=0.0)


def frontend_binary() -> Path | None:
    """`$RANKCAST_RUST_FRONTEND`, else the workspace's release build, else its debug build;
    a build older than the sources does not count (None: run `make rust-build`)."""
    given = os.environ.get(BINARY_ENV)
    if given:
        return Path(given) if os.access(given, os.X_OK) else None
    newest = _newest_source()
    for kind in ("release", "debug"):
        path = _WORKSPACE / "target" / kind / "rankcast-frontend"
        if os.access(path, os.X_OK) and path.stat().st_mtime >= newest:
            return path
    return None


def frontend_command(
    binary: Path, config: ApiServerConfig, index: int, engine: ClientAddresses
) -> list[str]:
    command = [
        str(binary),
        "--model-dir", str(config.model_dir),
        "--served-model-name", config.model_name,
        "--model-origin", config.model_origin,
        "--host", config.host,
        "--port", str(config.port),
        "--engine-input", engine.input,
        "--engine-output", engine.output,
        "--client-index", str(index),
        "--shutdown-timeout", f"{config.shutdown_timeout:g}",
    ]  # fmt: skip
    if config.api_key:
        command += ["--api-key", config.api_key]
    # The fleet reads chat outputs alike on every server: a request may reach any of them.
    if config.reasoning_parser is not None:
        command += ["--reasoning-parser", config.reasoning_parser]
    if config.tool_call_parser is not None:
        command += ["--tool-call-parser", config.tool_call_parser]
    return command + _discovery_flags(config)


def _discovery_flags(config: ApiServerConfig) -> list[str]:
    """What routers' discovery asks every API server (`/get_server_info`,
    `/kv_event_sources`), so that the Rust one answers what the Python ones do; the JSON is
    written here, by the encoders the Python servers answer with, and given back as it is."""
    flags = [
        "--block-size", str(config.block_size),
        "--enable-prefix-caching", "true" if config.enable_prefix_caching else "false",
        "--data-parallel-size", str(config.data_parallel_size),
        "--kv-event-sources",
        json.dumps(engine_sources(config.kv_events_config, config.data_parallel_size)),
    ]  # fmt: skip
    for flag, value in (
        ("--kv-events-config", config.kv_events_config),
        ("--speculative-config", config.speculative_config),
    ):
        if value is not None:
            flags += [flag, json.dumps(msgspec.to_builtins(value))]
    return flags


def run_rust_api_server(
    config: ApiServerConfig, index: int, engines: list[ClientAddresses], ready: Connection
) -> None:
    """Process entry point, with the signature of `run_api_server`."""
    role = f"rust_api_server_{index}"
    set_process_title(role)
    die_with_parent()
    binary = frontend_binary()
    if binary is None:
        ready.send(("error", "rankcast-frontend is not built or older than rust/: make rust-build"))
        return
    if len(engines) != 1:
        ready.send(("error", "a Rust API server serves one engine core (no data parallelism)"))
        return
    child = subprocess.Popen(
        frontend_command(binary, config, index, engines[0]),
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
    )

    def stop(signum: int, _frame: object) -> None:
        child.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    assert child.stderr is not None
    stderr = child.stderr
    reported = False
    for line in stderr:
        sys.stderr.write(f"{role}: {line}")
        if line.startswith(READY_MARK):
            ready.send(("ready",))
            reported = True
            break
    if not reported:
        code = child.wait()
        # Killed (a negative code) is a death the launcher restarts from; an exit of its own
        # is a failure it reported (in the lines passed through above).
        kind = "lost" if code < 0 else "error"
        ready.send((kind, f"rankcast-frontend exited during start-up (exit code {code})"))
        return

    def relay() -> None:
        for line in stderr:
            sys.stderr.write(f"{role}: {line}")

    threading.Thread(target=relay, daemon=True).start()
    code = child.wait()
    raise SystemExit(0 if code in (0, -signal.SIGTERM) else 1)
