"""The executor whose single rank lives in the engine core's own process."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

from rankcast.channel.doorbell import Doorbell
from rankcast.config import EngineConfig
from rankcast.executor.base import Executor, ExecutorError
from rankcast.model_files.source import ModelSource
from rankcast.worker.worker import start_worker


class UniProcExecutor(Executor):
    replies_crossed_the_wire = False

    def __init__(self, config: EngineConfig, source: ModelSource, engine_index: int = 0) -> None:
        super().__init__(config, source, engine_index)
        self.doorbell = Doorbell.create(1)
        # Data-parallel engine cores share the machine: each rank's local index is machine-wide.
        local_rank = engine_index * config.parallel.world_size
        self.worker = start_worker(config, source, 0, local_rank, doorbell=self.doorbell)

    def _collective(
        self,
        name: str,
        method: str | Callable[..., Any],
        args: tuple[Any, ...],
        timeout: float | None,
        unique_reply_rank: int | None,
    ) -> list[Any]:
        self.rpc_counts[name] += 1
        try:
            with self.worker.notifications.current():
                if isinstance(method, str):
                    result = self.worker.run_call(method, args)
                else:
                    result = method(self.worker, *args)
        except Exception as exc:
            raise ExecutorError(
                f"rank 0 failed in {name}: {exc}\n{traceback.format_exc()}"
            ) from exc
        return [result]

    def notifications_pending(self) -> bool:
        return self.doorbell.take()

    def shutdown(self) -> None:
        self.worker.close()
        self.worker.notifications.unregister()
        self.worker.runner = None
