"""How a frontend talks to an engine core: the same calls whether it runs in-process or not.

`EngineCoreClient` is the blocking flavour (in-process for the offline `LLM`, or a separate
process), `AsyncEngineCoreClient` the asyncio flavour an API server uses; both offer the same
operations.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from rankcast.config import EngineConfig
from rankcast.protocol import (
    PROTOCOL_VERSION,
    ClientHello,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    R,
    Utility,
)

if TYPE_CHECKING:
    from rankcast.model_files.source import ModelSource


class EngineCoreClient(ABC):
    """The frontend's handle on an engine core: requests, outputs, and the utilities
    (`rankcast.protocol.Utility`: one struct per verb, with its reply type)."""

    max_model_len: int

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next outputs (in-process: run one step to produce them)."""

    @abstractmethod
    def call(self, utility: Utility[R]) -> R:
        """Run an engine-core utility; its answer, as the utility's `REPLY` type."""

    @abstractmethod
    def shutdown(self) -> None: ...


class AsyncEngineCoreClient(ABC):
    """The asyncio flavour of `EngineCoreClient`."""

    max_model_len: int

    @abstractmethod
    async def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    async def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    async def get_output(self) -> EngineCoreOutputs: ...

    @abstractmethod
    async def call(self, utility: Utility[R]) -> R:
        """Run an engine-core utility; its answer, as the utility's `REPLY` type."""

    @abstractmethod
    def shutdown(self) -> None: ...


class InprocCore(Protocol):
    """What `InprocClient` drives: `rankcast.engine_core.core.EngineCore`, as seen from here.

    Named as a protocol so this package never imports the engine core's (rule of
    tests/test_import_layers.py); whoever builds the offline engine passes the class in.
    """

    engine_index: int
    stalled: bool

    def ready_info(self, client: int, hello: ClientHello) -> EngineReady: ...
    def start(self) -> None: ...
    def add_request(self, request: EngineCoreRequest, client: int | None = None) -> None: ...
    def abort_requests(self, request_ids: list[str]) -> None: ...
    def has_unfinished_requests(self) -> bool: ...
    def idle_timeout(self) -> float: ...
    def step(self) -> dict[int, EngineCoreOutputs]: ...
    def idle_outputs(self) -> dict[int, EngineCoreOutputs] | None: ...
    def call_utility(self, utility: Utility[R]) -> R: ...
    def shutdown(self) -> None: ...


# Builds the in-process engine core: `EngineCore` itself, passed by the entry points.
CoreFactory = Callable[[EngineConfig, "ModelSource"], InprocCore]


class InprocClient(EngineCoreClient):
    """Drives an `EngineCore` in the caller's thread, as its only client; used by the offline
    `LLM`. The core runs the same sequence as in its own process."""

    CLIENT_INDEX = 0

    def __init__(self, config: EngineConfig, source: ModelSource, build_core: CoreFactory) -> None:
        self.core = build_core(config, source)
        try:
            ready = self.core.ready_info(self.CLIENT_INDEX, ClientHello(PROTOCOL_VERSION, 0))
            self.core.start()
        except BaseException:
            self.core.shutdown()
            raise
        self.max_model_len = ready.max_model_len

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        """One step's outputs, or (nothing to run) what the idle engine has to say."""
        if self.core.has_unfinished_requests():
            if self.core.stalled:  # waiting on an adapter read: let the rank's thread run
                time.sleep(min(self.core.idle_timeout(), 0.005))
            return self.core.step()[self.CLIENT_INDEX]
        return self.idle_output()

    def idle_output(self) -> EngineCoreOutputs:
        """Between steps: what a rank published since (doorbell, poll), without stepping."""
        idle = self.core.idle_outputs() or {}
        return idle.get(self.CLIENT_INDEX) or EngineCoreOutputs(self.core.engine_index)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def call(self, utility: Utility[R]) -> R:
        return self.core.call_utility(utility)

    def shutdown(self) -> None:
        self.core.shutdown()
