"""`rankcast serve`: start one engine core and K API servers, watch them, stop them all.

The launcher converts the model once, then starts the engine cores and the API servers together (the
API servers share the port through SO_REUSEPORT, and bind it only once every engine core has
answered their hello). Every child is watched from the moment it starts (`fleet.py`): an API server
that dies is started again under the same index and catches up from the engine core's state
snapshot, so its `/metrics` agree with its siblings' again; an engine core that dies (or loses a
rank, which ends it) is started again under the next incarnation, with back-off and a give-up rule
(`supervision.py`), while its API servers answer 503 for it, then reconnect. On SIGTERM or SIGINT it
stops the API servers first (so in-flight HTTP requests end cleanly), then the engine cores, and
leaves no process behind.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess

from rankcast.addresses import EngineAddresses
from rankcast.api_server.metrics.fleet import MULTIPROC_DIR_ENV
from rankcast.api_server.response_store import RESPONSE_STORE_ENV
from rankcast.api_server.server_config import ApiServerConfig
from rankcast.config import ConfigError, EngineConfig, ServeConfig
from rankcast.launcher.children import api_server_process, engine_core_process
from rankcast.launcher.descendants import adopt_orphans, reap_everything
from rankcast.launcher.fleet import (
    API_SERVER_START_TIMEOUT_S,
    ENGINE_START_TIMEOUT_S,
    ChildSpec,
    Fleet,
    LaunchError,
    Role,
    StoppedDuringStartUp,
)
from rankcast.launcher.rust_api_server import BINARY_ENV as RUST_BINARY_ENV
from rankcast.launcher.rust_api_server import frontend_binary, run_rust_api_server
from rankcast.launcher.supervision import Supervision
from rankcast.model_files.source import ModelSource, resolve_model
from rankcast.process import (
    end_signal_wakeup,
    private_ipc_dir,
    remove_ipc_dirs_of,
    signal_wakeup,
)
from rankcast.supervisor_state import SUPERVISOR_STATE_ENV

# What the CLI catches: a fleet that could not start, named as the launcher's own failure.
__all__ = ["LaunchError", "StoppedDuringStartUp", "serve"]

logger = logging.getLogger(__name__)


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
    stop_requested, wakeup = _stop_on_signals()
    adopt_orphans()
    metrics_dir = private_ipc_dir("rankcast-metrics")
    # Every API server (restarted ones too: they inherit it) writes the series it counts into
    # this one directory, and each scrape sums them (rankcast/api_server/metrics/fleet.py); the
    # supervisor's state file beside them tells their /health whether the fleet has started
    # and whether an engine returns. Set before the first child is spawned: each inherits it.
    os.environ[MULTIPROC_DIR_ENV] = str(metrics_dir)
    state_path = metrics_dir / "supervisor.json"
    os.environ[SUPERVISOR_STATE_ENV] = str(state_path)
    # Stored `/v1/responses` (response_store.py): any API server continues a conversation.
    os.environ[RESPONSE_STORE_ENV] = str(metrics_dir / "responses")
    api_server_specs = _api_server_specs(server, config, model_name, source, engine_addresses)
    fleet = Fleet(
        spawn,
        [
            Role(
                Supervision.engine(dp),
                functools.partial(_engine_spec, config, source, addresses, dp),
                ENGINE_START_TIMEOUT_S,
            )
            for dp, addresses in enumerate(engine_addresses)
        ],
        [
            Role(Supervision.api_server(index), _every_time(spec), API_SERVER_START_TIMEOUT_S)
            for index, spec in enumerate(api_server_specs)
        ],
        state_path,
        stop_requested,
        on_started=lambda: _print_banner(server, model_name),
        woken=wakeup[0],
    )
    try:
        return fleet.run()
    except StoppedDuringStartUp as exc:
        logger.info("%s", exc)
        return 0
    finally:
        # API servers first, all at once: each drains its requests (--shutdown-timeout), and
        # the engines they need keep running until they are done.
        _stop(
            [r.process for r in fleet.api_servers if r.process is not None],
            timeout_s=server.shutdown_timeout + 10,
        )
        _stop([r.process for r in fleet.engines if r.process is not None])
        reap_everything()  # ranks, the Rust servers, the resource tracker: nothing outlives us
        for addresses in engine_addresses:
            addresses.cleanup()
        os.environ.pop(MULTIPROC_DIR_ENV, None)
        os.environ.pop(SUPERVISOR_STATE_ENV, None)
        os.environ.pop(RESPONSE_STORE_ENV, None)
        shutil.rmtree(metrics_dir, ignore_errors=True)
        end_signal_wakeup(wakeup)


def _every_time(spec: ChildSpec) -> Callable[[int], ChildSpec]:
    """An API server is started with the same arguments whichever start it is."""
    return lambda _incarnation: spec


def _stop_on_signals() -> tuple[threading.Event, tuple[socket.socket, socket.socket]]:
    """An event SIGTERM and SIGINT set: the supervision loop ends on it, and the `finally` of
    `serve` then stops every child in order instead of the signal killing the launcher. And the
    signal's wakeup sockets (`signal_wakeup`), whose readable end the loop waits on beside its
    children: without it a stop began only at the loop's next pass (up to 0.2 s later)."""
    stop_requested = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop_requested.set()

    wakeup = signal_wakeup()
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop_requested, wakeup


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
        reasoning_parser=server.reasoning_parser,
        tool_call_parser=server.tool_call_parser if server.enable_auto_tool_choice else None,
        speculative_config=config.scheduler.speculative_config,
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
