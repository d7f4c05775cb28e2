"""`rankcast serve`: start one engine core and K API servers, watch them, stop them all.

The launcher converts the model once, starts the engine core and waits for it to load, then
starts the API servers (which share the port through SO_REUSEPORT). An API server that dies is
started again under the same index; it catches up from the engine core's state snapshot, so its
`/metrics` agree with its siblings' again. An engine core that dies (or loses a rank, which ends
it) is started again under the next incarnation, with back-off and a give-up rule
(`supervision.py`); meanwhile its API servers answer 503 for it, then reconnect. On SIGTERM or
SIGINT it stops the API servers first (so in-flight HTTP requests end cleanly), then the engine
cores, and leaves no process behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from rankcast.addresses import EngineAddresses
from rankcast.config import ConfigError, EngineConfig, ServeConfig
from rankcast.descendants import adopt_orphans, reap_adopted, reap_everything
from rankcast.entrypoints.children import api_server_process, engine_core_process
from rankcast.entrypoints.openai.server_config import ApiServerConfig
from rankcast.entrypoints.rust_api_server import BINARY_ENV as RUST_BINARY_ENV
from rankcast.entrypoints.rust_api_server import frontend_binary, run_rust_api_server
from rankcast.entrypoints.supervision import SUPERVISOR_STATE_ENV, EngineSupervision, write_states
from rankcast.metrics.fleet import MULTIPROC_DIR_ENV
from rankcast.model.source import ModelSource, resolve_model
from rankcast.process import private_ipc_dir, remove_ipc_dirs_of

logger = logging.getLogger(__name__)


# How long a child may take to report ready: an engine core loads (and may first convert) the
# model; an API server only loads the tokenizer and connects.
ENGINE_START_TIMEOUT_S = 900.0
API_SERVER_START_TIMEOUT_S = 300.0

# (process name, target, args): a child to start; `_start_all` appends its readiness pipe.
ChildSpec = tuple[str, Callable[..., None], tuple[Any, ...]]


class LaunchError(RuntimeError):
    """A process failed to start; the message says which and why."""


class StoppedDuringStartUp(LaunchError):
    """SIGTERM or SIGINT arrived while children were still starting: not a failure."""


def _check_port_free(host: str, port: int) -> None:
    """Fail early, and without SO_REUSEPORT, so we never silently share a port with a stranger.
    SO_REUSEADDR, as the API servers' own sockets have it: connections of a previous run still
    in TIME_WAIT do not hold the port, only a socket listening on it does."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise LaunchError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def _wait_ready(
    name: str, proc: BaseProcess, conn: Connection, timeout_s: float, stop: threading.Event
) -> None:
    """Wait for a child's ("ready", ...) message; its ("error", why) or its death is fatal, and
    a stop request ends the wait at once (a model can take minutes to load)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        # The pipe first: a child whose "ready" is already waiting there is serving (a busy
        # machine can delay this loop by seconds), so a stop arriving now must drain it like
        # any started child, not kill it as one still loading.
        if conn.poll(0 if stop.is_set() else 0.2):
            try:
                kind, *detail = conn.recv()
            except EOFError:  # it died before a word: its pipe closed with it
                kind, detail = "exited", []
            if kind == "ready":
                return
            if stop.is_set():  # Ctrl-C reaches a loading child too: that is the stop, not a fault
                raise StoppedDuringStartUp(f"stopped while {name} was starting")
            if kind == "exited":
                proc.join(5)
                raise LaunchError(f"{name} exited during start-up (exit code {proc.exitcode})")
            raise LaunchError(f"{name} failed to start: {detail[0] if detail else kind}")
        if stop.is_set():
            raise StoppedDuringStartUp(f"stopped while {name} was starting")
        if not proc.is_alive():
            raise LaunchError(f"{name} exited during start-up (exit code {proc.exitcode})")
    raise LaunchError(f"{name} did not become ready in {timeout_s:.0f} s")


def _start_all(
    spawn: SpawnContext,
    specs: list[ChildSpec],
    timeout_s: float,
    stop: threading.Event,
    pipes: dict[int, Connection] | None = None,
) -> list[BaseProcess]:
    """Start every (name, target, args) child with a readiness pipe appended to its args, then
    wait until each reports ready. If one fails, all of this group are stopped before raising.
    `pipes`: where to keep each started child's pipe by pid, for what it says when it fails."""
    started: list[tuple[BaseProcess, Connection]] = []
    for name, target, args in specs:
        read, write = spawn.Pipe(duplex=False)
        proc = spawn.Process(target=target, args=(*args, write), name=name)
        proc.start()
        write.close()
        started.append((proc, read))
    try:
        for child, pipe in started:
            _wait_ready(child.name.replace("_", " "), child, pipe, timeout_s, stop)
    except LaunchError:
        _stop([child for child, _ in started], timeout_s=2.0)
        raise
    if pipes is not None:
        pipes.update((proc.pid, pipe) for proc, pipe in started if proc.pid is not None)
    return [proc for proc, _ in started]


def _last_words(pipes: dict[int, Connection], proc: BaseProcess) -> str | None:
    """What a dead child said of its failure on its pipe, if anything (the pipe is closed)."""
    pipe = pipes.pop(proc.pid, None) if proc.pid is not None else None
    if pipe is None:
        return None
    words = None
    with contextlib.suppress(EOFError, OSError):
        while pipe.poll(0):
            kind, *detail = pipe.recv()
            if kind == "failed" and detail:
                words = str(detail[0])
    pipe.close()
    return words


def _stop(processes: list[BaseProcess], timeout_s: float = 10.0) -> None:
    """Terminate, wait up to `timeout_s` for all together, then kill whatever is left, and
    remove the IPC directories a killed one could not."""
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
    for proc in processes:
        if proc.pid is not None:
            remove_ipc_dirs_of(proc.pid)


@dataclass
class _Children:
    """The processes `serve` started, as they are now (a restarted API server replaces its
    predecessor), so that shutting down stops exactly these."""

    engines: list[BaseProcess] = field(default_factory=list)
    # Each engine core's readiness pipe, by pid: it says there why it failed.
    engine_pipes: dict[int, Connection] = field(default_factory=dict)
    api_servers: list[BaseProcess] = field(default_factory=list)


def serve(config: EngineConfig, server: ServeConfig) -> int:
    """Run engine cores and API servers until SIGTERM/SIGINT; the exit code for the command."""
    _check_port_free(server.host, server.port)
    source = resolve_model(config.model.model)
    model_name = config.model.served_model_name or source.name
    for name, _ in config.lora.lora_modules:
        if name == model_name:
            # `model` picks the base model by this name: such an adapter could never be used.
            raise ConfigError(
                f"--lora-modules: {name!r} is the base model's served name; "
                "give the adapter a name of its own"
            )
    if (
        config.parallel.data_parallel_size > 1
        and server.routing_policy in ("prefix", "auto")
        and config.cache.enable_prefix_caching
        and not config.cache.kv_events
    ):
        # Routing by prefix reads each engine's KV index from its KV-cache events.
        config = dataclasses.replace(
            config, cache=dataclasses.replace(config.cache, kv_events=True)
        )
    if server.rust_api_server_count and config.parallel.data_parallel_size > 1:
        raise ConfigError(
            "--rust-api-server-count: a Rust API server serves one engine core; "
            "it cannot be combined with --data-parallel-size > 1 yet"
        )
    if server.rust_api_server_count and frontend_binary() is None:
        raise ConfigError(
            "--rust-api-server-count: rankcast-frontend is not built, or older than its "
            f"sources in rust/ (run make rust-build, or point {RUST_BINARY_ENV} at a build)"
        )
    clients = server.api_server_count + server.rust_api_server_count
    engine_addresses = [
        EngineAddresses.ipc(clients, engine_index=dp)
        for dp in range(config.parallel.data_parallel_size)
    ]
    spawn = multiprocessing.get_context("spawn")
    stop_requested = _stop_on_signals()
    adopt_orphans()
    children = _Children()
    metrics_dir = private_ipc_dir("rankcast-metrics")
    supervision = _Supervision(
        [EngineSupervision(dp) for dp in range(len(engine_addresses))],
        metrics_dir / "supervisor.json",
        lambda dp, incarnation: _engine_spec(config, source, engine_addresses[dp], dp, incarnation),
    )
    try:
        children.engines = _start_all(
            spawn,
            [supervision.spec(dp, 0) for dp in range(len(engine_addresses))],
            ENGINE_START_TIMEOUT_S,
            stop_requested,
            children.engine_pipes,
        )
        # Every API server (restarted ones too: they inherit it) writes the series it counts
        # into this one directory, and each scrape sums them (rankcast/metrics/fleet.py); the
        # supervisor's state file beside them tells their /health whether an engine returns.
        os.environ[MULTIPROC_DIR_ENV] = str(metrics_dir)
        os.environ[SUPERVISOR_STATE_ENV] = str(supervision.state_path)
        supervision.write()
        api_server_specs = _api_server_specs(server, config, model_name, source, engine_addresses)
        children.api_servers = _start_all(
            spawn, api_server_specs, API_SERVER_START_TIMEOUT_S, stop_requested
        )
        _print_banner(server, model_name)
        return _supervise(spawn, api_server_specs, children, supervision, stop_requested)
    except StoppedDuringStartUp as exc:
        logger.info("%s", exc)
        return 0
    finally:
        # API servers first, all at once: each drains its requests (--shutdown-timeout), and
        # the engines they need keep running until they are done.
        _stop(children.api_servers, timeout_s=server.shutdown_timeout + 10)
        _stop(children.engines)
        reap_everything()  # ranks, the Rust servers, the resource tracker: nothing outlives us
        for addresses in engine_addresses:
            addresses.cleanup()
        os.environ.pop(MULTIPROC_DIR_ENV, None)
        os.environ.pop(SUPERVISOR_STATE_ENV, None)
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _stop_on_signals() -> threading.Event:
    """An event SIGTERM and SIGINT set: the supervision loop ends on it, and the `finally` of
    `serve` then stops every child in order instead of the signal killing the launcher."""
    stop_requested = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop_requested.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop_requested


def _engine_spec(
    config: EngineConfig,
    source: ModelSource,
    addresses: EngineAddresses,
    dp: int,
    incarnation: int,
) -> ChildSpec:
    """One engine core per data-parallel rank (they load side by side, each with its own
    executor and ranks), on the same addresses whichever incarnation it is."""
    args = (config, source, addresses, dp, incarnation)
    return (f"engine_core_dp{dp}", engine_core_process, args)


@dataclass
class _Supervision:
    """Every engine core's restart bookkeeping, where its state is published, and how to
    make the spec of one incarnation."""

    engines: list[EngineSupervision]
    state_path: Path
    spec: Callable[[int, int], ChildSpec]

    def write(self) -> None:
        write_states(self.state_path, self.engines)


def _fleet_words(server: ServeConfig) -> str:
    """`2 API server(s)`, `1 API server(s) and 1 Rust API server(s)`, `1 Rust API server(s)`."""
    parts = []
    if server.api_server_count:
        parts.append(f"{server.api_server_count} API server(s)")
    if server.rust_api_server_count:
        parts.append(f"{server.rust_api_server_count} Rust API server(s)")
    return " and ".join(parts)


def _api_server_specs(
    server: ServeConfig,
    config: EngineConfig,
    model_name: str,
    source: ModelSource,
    engine_addresses: list[EngineAddresses],
) -> list[ChildSpec]:
    """One API server per index (the Python ones first, then the Rust ones); every API server
    connects to every engine core. Kept by `serve`, so that a dead API server is started again
    with the same arguments."""
    server_config = ApiServerConfig(
        server.host,
        server.port,
        model_name,
        source.model_dir,
        str(source.origin),
        server.api_key,
        server.allow_runtime_lora_updating,
        server.shutdown_timeout,
        config.cache.block_size,
        config.cache.enable_prefix_caching,
        config.parallel.data_parallel_size,
        config.cache.kv_events_config,
        server.routing_policy,
        config.lora.host_capacity if config.lora.enable_lora else None,
    )
    python = [
        (
            f"api_server_{index}",
            api_server_process,
            (server_config, index, [addresses.clients[index] for addresses in engine_addresses]),
        )
        for index in range(server.api_server_count)
    ]
    first = server.api_server_count
    rust = [
        (
            f"rust_api_server_{index}",
            run_rust_api_server,
            (server_config, index, [addresses.clients[index] for addresses in engine_addresses]),
        )
        for index in range(first, first + server.rust_api_server_count)
    ]
    return python + rust


def _supervise(
    spawn: SpawnContext,
    api_server_specs: list[ChildSpec],
    children: _Children,
    supervision: _Supervision,
    stop_requested: threading.Event,
) -> int:
    """Watch the children until a stop is requested (exit code 0) or every API server is gone
    (1). A dead engine core is started again under its next incarnation (`supervision.py`:
    back-off, then give up after repeated failures); a dead API server is started again while
    every engine core lives (it could not connect otherwise), unless its restart already
    failed."""
    given_up: set[int] = set()
    while not stop_requested.wait(0.5):
        reap_adopted({p.pid for p in (*children.engines, *children.api_servers) if p.pid})
        if all(not proc.is_alive() for proc in children.api_servers):
            logger.error("every API server has exited; shutting down")
            return 1
        _restart_engines(spawn, children, supervision, stop_requested)
        if all(engine.is_alive() for engine in children.engines):
            _restart_api_servers(
                spawn, api_server_specs, children.api_servers, given_up, stop_requested
            )
    return 0


def _restart_engines(
    spawn: SpawnContext,
    children: _Children,
    supervision: _Supervision,
    stop_requested: threading.Event,
) -> None:
    """Note each newly dead engine core, and start again those whose back-off has passed."""
    changed = False
    for dp, engine in enumerate(children.engines):
        state = supervision.engines[dp]
        if engine.is_alive() or state.given_up is not None:
            continue
        if state.retry_at is None:  # a death not seen before
            if engine.pid is not None:
                remove_ipc_dirs_of(engine.pid)  # what a killed engine core could not remove
            why = _last_words(children.engine_pipes, engine)
            state.failed(f"exited (code {engine.exitcode})" + (f": {why}" if why else ""))
            changed = True
        if not state.due() or stop_requested.is_set():
            continue
        supervision.write()
        state.incarnation += 1
        try:
            children.engines[dp] = _start_all(
                spawn,
                [supervision.spec(dp, state.incarnation)],
                ENGINE_START_TIMEOUT_S,
                stop_requested,
                children.engine_pipes,
            )[0]
        except StoppedDuringStartUp:
            return
        except LaunchError as exc:
            state.failed(str(exc))
        else:
            state.retry_at = None
            logger.info("engine core %d is serving again (incarnation %d)", dp, state.incarnation)
        changed = True
    if changed:
        supervision.write()


def _restart_api_servers(
    spawn: SpawnContext,
    api_server_specs: list[ChildSpec],
    api_servers: list[BaseProcess],
    given_up: set[int],
    stop_requested: threading.Event,
) -> None:
    """Start each dead API server again under its index, in place in `api_servers`; one whose
    restart fails joins `given_up` and is not tried again."""
    for index, proc in enumerate(api_servers):
        if proc.is_alive() or index in given_up or stop_requested.is_set():
            continue
        logger.error("API server %d exited (code %s); starting it again", index, proc.exitcode)
        try:
            api_servers[index] = _start_all(
                spawn, [api_server_specs[index]], API_SERVER_START_TIMEOUT_S, stop_requested
            )[0]
        except LaunchError as exc:
            given_up.add(index)
            logger.error("%s; not trying again", exc)


def _print_banner(server: ServeConfig, model_name: str) -> None:
    """Tell whoever started `rankcast serve` where it listens and how to try it."""
    url = f"http://{server.host}:{server.port}"
    auth = f' -H "Authorization: Bearer {server.api_key}"' if server.api_key else ""
    body = (
        f'{{"model": "{model_name}", '
        '"messages": [{"role": "user", "content": "What is the capital of France?"}]}'
    )
    lines = [
        "",
        f"rankcast is serving {model_name} on {url} with {_fleet_words(server)}. Try:",
        "",
        f"  curl {url}/v1/chat/completions{auth} \\",
        f"    -H 'Content-Type: application/json' -d '{body}'",
        "",
        "  or, with the openai client:",
        f"    OpenAI(base_url='{url}/v1', api_key='{server.api_key or 'none'}')",
        "",
        f"  metrics: {url}/metrics    health: {url}/health    stop: Ctrl-C",
        "",
    ]
    print("\n".join(lines), flush=True)
