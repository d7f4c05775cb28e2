"""The interface between the engine core and its ranks, whatever carries the calls.

The engine core never touches a worker directly: it calls `collective_rpc` to reach every rank
and `execute_model` to run a step, so in-process, multi-process and Ray executors are
interchangeable.
"""

from __future__ import annotations

import collections
import dataclasses
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import msgspec

from rankcast.channel.events import WorkerNotification
from rankcast.config import EngineConfig
from rankcast.model_files.source import ModelSource
from rankcast.protocol import (
    AdapterRead,
    ExecuteModel,
    ModelRunnerOutput,
    R,
    RankCall,
    SchedulerOutput,
    StepReply,
    TakeNotifications,
)
from rankcast.worker.extension import worker_class


def method_name(method: str | Callable[..., Any]) -> str:
    """How a collective call names its target on the wire: a Worker method or module:qualname."""
    if isinstance(method, str):
        return method
    return f"{method.__module__}:{method.__qualname__}"


def declared_reply_type(worker_cls: type, method: str | Callable[..., Any]) -> Any:
    """What `method` says it returns (a Worker or extension method, or a module-level
    function called with the worker); Any when it does not say."""
    fn = getattr(worker_cls, method, None) if isinstance(method, str) else method
    if fn is None:
        return Any
    try:
        return typing.get_type_hints(fn).get("return", Any)
    except Exception:
        return Any


def convert_reply(reply: Any, reply_type: Any, plain: bool = False) -> Any:
    """A rank's reply as the caller sees it, whichever executor carried it: first as the wire
    would carry it (plain msgpack data: a struct becomes its array or map, a tuple a list), then
    into the declared type. An in-process reply goes through the same steps as one that crossed
    a socket, so `uni`, `mp` and `ray` give equal results."""
    if not plain:  # `plain`: it crossed the wire already (decoded msgpack), skip this step
        reply = msgspec.to_builtins(reply, builtin_types=(bytes, bytearray, memoryview))
    if reply_type is Any or reply_type is None or reply_type is type(None):
        return reply
    return msgspec.convert(reply, reply_type)


@dataclasses.dataclass
class StepResult:
    """One step as the engine sees it: the output rank's tokens, and per rank (in rank order;
    None for a rank that had none) the events it drained as it ended the step and the adapter
    reads it finished."""

    output: ModelRunnerOutput | None
    notifications: list[list[WorkerNotification] | None]
    adapter_reads: list[list[AdapterRead] | None]


def step_result(replies: list[StepReply], output_rank: int) -> StepResult:
    """Every executor's step replies, in rank order, as the engine core sees the step."""
    return StepResult(
        replies[output_rank].output,
        [reply.notifications for reply in replies],
        [reply.adapter_reads for reply in replies],
    )


class ExecutorError(RuntimeError):
    """A rank failed; the message names it and carries its traceback when there is one."""


class RankLostError(ExecutorError):
    """A rank's process died (or its Ray actor or host was lost), as opposed to a rank that
    reported an error of its own: the launcher starts an engine core that lost a rank during
    start-up again, where a reported error (a bad model file, say) would only repeat."""


class Executor(ABC):
    def __init__(self, config: EngineConfig, source: ModelSource, engine_index: int = 0) -> None:
        self.config = config
        self.source = source
        self.engine_index = engine_index
        # Called (from a monitor thread) when a rank dies, so an idle engine fails promptly too.
        self.failure_callback: Callable[[str], None] | None = None
        # Collective calls made, by method: what "a quiet step makes no RPC" is checked against.
        self.rpc_counts: collections.Counter[str] = collections.Counter()
        self._worker_cls: type | None = None

    # Whether `_collective` brings replies back as decoded msgpack (mp, ray) or as the objects
    # the ranks returned (uni): those take the wire's plain form first, for equal results.
    replies_crossed_the_wire = True

    # ---- the calls the engine makes: one struct each (`rankcast.protocol.RankCall`) ----

    def call(self, rank_call: RankCall[R], timeout: float | None = None) -> list[R]:
        """Make one of the engine core's calls on every rank; each rank's answer, as the call's
        `REPLY` type, in rank order (the same whichever backend carried it)."""
        args = tuple(rank_call.wire_args())
        return self.collective_rpc(rank_call.METHOD, args, timeout, reply_type=rank_call.REPLY)

    def take_notifications(self) -> list[list[WorkerNotification] | None]:
        """Drain every rank's notification buffer: one batch (or None) per rank, in rank order
        (what the notification channel's gather needs of the ranks)."""
        return self.call(TakeNotifications())

    def execute_model(self, batch: SchedulerOutput) -> StepResult:
        """Run one step on every rank, whichever backend: every rank answers, so each one's
        events come back with the step (stage 0 of a pipeline answers while the later stages
        still run)."""
        return step_result(self.call(ExecuteModel(batch)), self.config.parallel.output_rank)

    # ---- the generic call ----

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
        reply_type: Any = ...,
    ) -> list[Any]:
        """Call `method` on every rank; replies in rank order, converted once, here, to
        `reply_type` (by default what the method declares it returns on this engine's worker
        class, extension included).

        With `unique_reply_rank`, only that rank's reply is returned (as a one-element list).
        """
        if reply_type is ...:
            reply_type = declared_reply_type(self.worker_cls, method)
        replies = self._collective(method_name(method), method, args, timeout, unique_reply_rank)
        plain = self.replies_crossed_the_wire
        return [convert_reply(reply, reply_type, plain) for reply in replies]

    @property
    def worker_cls(self) -> type:
        """The class every rank runs: `Worker` with the configured extension mixed in."""
        if self._worker_cls is None:
            # Imported at the first call, not with this module: the worker brings torch, which
            # an engine core whose ranks are processes of their own does not need before its
            # ranks are started (they import it meanwhile: a TP=2 start ~1 s shorter).
            from rankcast.worker.worker import Worker

            self._worker_cls = worker_class(Worker, self.config.parallel.worker_extension_cls)
        return self._worker_cls

    @abstractmethod
    def _collective(
        self,
        name: str,
        method: str | Callable[..., Any],
        args: tuple[Any, ...],
        timeout: float | None,
        unique_reply_rank: int | None,
    ) -> list[Any]:
        """Carry one call to the ranks and bring back each reply as it arrived (a backend's
        only job); `name` is how the call is named on the wire."""

    def notifications_pending(self) -> bool:
        """Whether any rank rang the notification doorbell since the last look (and forget it).

        Must cost no RPC: it is asked after every step.
        """
        return False

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every rank; safe to call twice."""
