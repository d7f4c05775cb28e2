"""The interface between the engine core and its ranks, whatever carries the calls.

The engine core never touches a worker directly: it calls `collective_rpc` to reach every rank
and `execute_model` to run a step, so in-process, multi-process and Ray executors are
interchangeable.
"""

from __future__ import annotations

import collections
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from rankcast.config import EngineConfig
from rankcast.model.source import ModelSource
from rankcast.protocol import ModelRunnerOutput, SchedulerOutput


def method_name(method: str | Callable[..., Any]) -> str:
    """How a collective call names its target on the wire: a Worker method or module:qualname."""
    if isinstance(method, str):
        return method
    return f"{method.__module__}:{method.__qualname__}"


def return_type(method: str) -> Any:
    """The Worker method's declared return type, so struct replies come back as structs."""
    from rankcast.worker.worker import Worker

    fn = getattr(Worker, method, None)
    if fn is None:
        return Any
    try:
        return typing.get_type_hints(fn).get("return", Any)
    except Exception:
        return Any


class ExecutorError(RuntimeError):
    """A rank failed; the message names it and carries its traceback when there is one."""


class Executor(ABC):
    def __init__(self, config: EngineConfig, source: ModelSource, engine_index: int = 0) -> None:
        self.config = config
        self.source = source
        self.engine_index = engine_index
        # Called (from a monitor thread) when a rank dies, so an idle engine fails promptly too.
        self.failure_callback: Callable[[str], None] | None = None
        # Collective calls made, by method: what "a quiet step makes no RPC" is checked against.
        self.rpc_counts: collections.Counter[str] = collections.Counter()

    @classmethod
    def create(cls, config: EngineConfig, source: ModelSource, engine_index: int = 0) -> Executor:
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

    @abstractmethod
    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> list[Any]:
        """Call `method` on every rank; replies come back in rank order.

        With `unique_reply_rank`, only that rank's reply is returned (as a one-element list).
        """

    def execute_model(self, batch: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step on every rank and return the output rank's result."""
        output_rank = self.config.parallel.output_rank
        return self.collective_rpc("execute_model", (batch,), unique_reply_rank=output_rank)[0]

    def notifications_pending(self) -> bool:
        """Whether any rank rang the notification doorbell since the last look (and forget it).

        Must cost no RPC: it is asked after every step.
        """
        return False

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every rank; safe to call twice."""
