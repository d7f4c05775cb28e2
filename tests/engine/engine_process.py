"""An engine core in its own process, as `rankcast serve` runs it, for tests that drive it
through clients of their own (Python, the Rust client, the Rust API server)."""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path

from rankcast.addresses import EngineAddresses
from rankcast.config import EngineConfig
from rankcast.engine_core.core_proc import run_engine_core
from rankcast.model_files.source import resolve_model


@contextlib.contextmanager
def engine_core_process(
    model_dir: Path, clients: int = 2, **options: object
) -> Iterator[tuple[BaseProcess, EngineAddresses]]:
    """An engine core for `model_dir` with `clients` client slots (float32 and 64 KV blocks
    unless `options`, named like the CLI flags, say otherwise), ready when handed over;
    terminated (killed if need be) and its sockets removed afterwards."""
    settings: dict[str, object] = {"dtype": "float32", "num_blocks": 64, **options}
    config = EngineConfig.from_kwargs(model=str(model_dir), **settings)
    addresses = EngineAddresses.ipc(clients)
    spawn = multiprocessing.get_context("spawn")
    read, write = spawn.Pipe(duplex=False)
    proc = spawn.Process(
        target=run_engine_core,
        args=(config, resolve_model(str(model_dir)), addresses, 0, 0, write),
    )
    proc.start()
    try:
        assert read.poll(120), "engine core did not report readiness"
        assert read.recv()[0] == "ready"
        yield proc, addresses
    finally:
        proc.terminate()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()
        addresses.cleanup()


def python_greedy(
    addresses: EngineAddresses, client_index: int, prompt_ids: list[int], max_tokens: int
) -> list[int]:
    """The tokens the engine generates greedily (EOS ignored) for a Python client in slot
    `client_index`: what another client of the same engine must be shown."""
    from rankcast.engine_client.mp_client import SyncMPClient
    from rankcast.protocol import EngineCoreRequest
    from rankcast.sampling_params import SamplingParams

    client = SyncMPClient(addresses.clients[client_index], client_index, timeout_s=60)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        client.add_request(EngineCoreRequest("py", prompt_ids, params, client_index=client_index))
        tokens: list[int] = []
        while True:
            for output in client.get_output(timeout_s=60).outputs:
                tokens.extend(output.new_token_ids)
                if output.finished:
                    return tokens
    finally:
        client.shutdown()
