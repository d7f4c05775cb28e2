"""Which executor an engine gets: chosen by `--distributed-executor-backend`.

Kept apart from `base.py` so that the interface does not import its implementations (each
backend imports the interface; nothing imports back).
"""

from __future__ import annotations

from rankcast.config import EngineConfig
from rankcast.executor.base import Executor
from rankcast.model_files.source import ModelSource


def create_executor(config: EngineConfig, source: ModelSource, engine_index: int = 0) -> Executor:
    """Start the configured backend's ranks; Ray is imported only when it is asked for."""
    backend = config.parallel.backend
    if backend == "uni":
        from rankcast.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config, source, engine_index)
    if backend == "ray":
        from rankcast.executor.ray_executor import RayExecutor

        return RayExecutor(config, source, engine_index)
    if backend == "mp":
        from rankcast.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config, source, engine_index)
    raise ValueError(f"unknown executor backend {backend!r}")
