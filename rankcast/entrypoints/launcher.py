"""`rankcast serve`: start one engine core and K API servers, watch them, stop them all.

The launcher converts the model once, starts the engine core and waits for it to load, then
starts the API servers (which share the port through SO_REUSEPORT). An API server that dies is
started again under the same index; it catches up from the engine core's state snapshot, so its
`/metrics` agree with its siblings' again. On SIGTERM or SIGINT it stops
the API servers first (so in-flight HTTP requests end cleanly), then the engine core, and leaves
no process behind. If the engine core dies, the API servers stay up and answer 503, so a probe
or an operator sees the failure instead of a refused connection.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any

from rankcast.config import EngineConfig
from rankcast.engine.addresses import EngineAddresses
from rankcast.engine.core_proc import run_engine_core
from rankcast.entrypoints.openai.api_server import ApiServerConfig, run_api_server
from rankcast.model.source import resolve_model

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeArgs:
    host: str = "127.0.0.1"
    port: int = 8000
    api_server_count: int = 1
    api_key: str | None = None
    allow_runtime_lora_updating: bool = False


class LaunchError(RuntimeError):
    """A process failed to start; the message says which and why."""


def _check_port_free(host: str, port: int) -> None:
    """Fail early, and without SO_REUSEPORT, so we never silently share a port with a stranger."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise LaunchError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def _wait_ready(name: str, proc: BaseProcess, conn: Connection, timeout_s: float) -> None:
    """Wait for a child's ("ready", ...) message; its ("error", why) or its death is fatal."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if conn.poll(0.2):
            kind, *detail = conn.recv()
            if kind != "ready":
                raise LaunchError(f"{name} failed to start: {detail[0] if detail else kind}")
            return
        if not proc.is_alive():
            raise LaunchError(f"{name} exited during start-up (exit code {proc.exitcode})")
    raise LaunchError(f"{name} did not become ready in {timeout_s:.0f} s")


def _start_all(
    spawn: SpawnContext,
    specs: list[tuple[str, Callable[..., None], tuple[Any, ...]]],
    timeout_s: float,
) -> list[BaseProcess]:
    """Start every (name, target, args) child with a readiness pipe appended to its args, then
    wait until each reports ready. If one fails, all of this group are stopped before raising."""
    started: list[tuple[BaseProcess, Connection]] = []
    for name, target, args in specs:
        read, write = spawn.Pipe(duplex=False)
        proc = spawn.Process(target=target, args=(*args, write), name=name)
        proc.start()
        write.close()
        started.append((proc, read))
    try:
        for child, pipe in started:
            _wait_ready(child.name.replace("_", " "), child, pipe, timeout_s)
    except LaunchError:
        _stop([child for child, _ in started])
        raise
    return [proc for proc, _ in started]


def _stop(processes: list[BaseProcess], timeout_s: float = 10.0) -> None:
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + timeout_s
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in processes:
        if proc.is_alive():
            logger.warning("%s did not stop in time; killing it", proc.name)
            proc.kill()
            proc.join(2)


def serve(config: EngineConfig, args: ServeArgs) -> int:
    _check_port_free(args.host, args.port)
    source = resolve_model(config.model.model)
    model_name = config.model.served_model_name or source.name
    data_parallel = config.parallel.data_parallel_size
    engine_addresses = [
        EngineAddresses.ipc(args.api_server_count, engine_index=dp) for dp in range(data_parallel)
    ]
    spawn = multiprocessing.get_context("spawn")
    stop_requested = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop_requested.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    engines: list[BaseProcess] = []
    api_servers: list[BaseProcess] = []
    try:
        # Data-parallel engine cores load side by side; each has its own executor and ranks.
        engines = _start_all(
            spawn,
            [
                (f"engine_core_dp{dp}", run_engine_core, (config, source, addresses, dp))
                for dp, addresses in enumerate(engine_addresses)
            ],
            timeout_s=900,
        )
        server_config = ApiServerConfig(
            args.host,
            args.port,
            model_name,
            source.model_dir,
            str(source.origin),
            args.api_key,
            args.allow_runtime_lora_updating,
        )
        # Every API server connects to every engine core.
        server_specs = [
            (
                f"api_server_{index}",
                run_api_server,
                (server_config, index, [a.clients[index] for a in engine_addresses]),
            )
            for index in range(args.api_server_count)
        ]
        api_servers = _start_all(spawn, server_specs, timeout_s=300)
        _print_banner(args, model_name)
        reported: set[int] = set()
        given_up: set[int] = set()
        while not stop_requested.wait(0.5):
            if all(not proc.is_alive() for proc in api_servers):
                logger.error("every API server has exited; shutting down")
                return 1
            for index, proc in enumerate(api_servers):
                if proc.is_alive() or index in given_up or stop_requested.is_set() or reported:
                    continue
                logger.error(
                    "API server %d exited (code %s); starting it again", index, proc.exitcode
                )
                try:
                    api_servers[index] = _start_all(spawn, [server_specs[index]], timeout_s=300)[0]
                except LaunchError as exc:
                    given_up.add(index)
                    logger.error("%s; not trying again", exc)
            for dp, engine in enumerate(engines):
                if not engine.is_alive() and dp not in reported:
                    reported.add(dp)
                    logger.error(
                        "engine core %d exited (code %s); API servers answer 503 until restarted",
                        dp,
                        engine.exitcode,
                    )
        return 0
    finally:
        _stop(api_servers)
        _stop(engines)
        for addresses in engine_addresses:
            addresses.cleanup()


def _print_banner(args: ServeArgs, model_name: str) -> None:
    url = f"http://{args.host}:{args.port}"
    auth = f' -H "Authorization: Bearer {args.api_key}"' if args.api_key else ""
    body = (
        f'{{"model": "{model_name}", '
        '"messages": [{"role": "user", "content": "What is the capital of France?"}]}'
    )
    lines = [
        "",
        f"rankcast is serving {model_name} on {url} "
        f"with {args.api_server_count} API server(s). Try:",
        "",
        f"  curl {url}/v1/chat/completions{auth} \\",
        f"    -H 'Content-Type: application/json' -d '{body}'",
        "",
        "  or, with the openai client:",
        f"    OpenAI(base_url='{url}/v1', api_key='{args.api_key or 'none'}')",
        "",
        f"  metrics: {url}/metrics    health: {url}/health    stop: Ctrl-C",
        "",
    ]
    print("\n".join(lines), flush=True)
