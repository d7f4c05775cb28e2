"""An engine core in its own process, as `rankcast serve` runs it, for tests that drive it
through clients of their own (Python, the Rust client, the Rust API server)."""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path

from rankcast.config import EngineConfig
from rankcast.engine.addresses import EngineAddresses
from rankcast.engine.core_proc import run_engine_core
from rankcast.model.source import resolve_model


@contextlib.contextmanager
def engine_core_process(
    model_dir: Path, clients: int = 2, num_blocks: int = 64
) -> Iterator[tuple[BaseProcess, EngineAddresses]]:
    """A float32 engine core for `model_dir` with `clients` client slots, ready when handed
    over; terminated (killed if need be) and its sockets removed afterwards."""
    config = EngineConfig.from_kwargs(model=str(model_dir), dtype="float32", num_blocks=num_blocks)
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
