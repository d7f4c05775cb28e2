"""Ranks as Ray actors, possibly on other machines, with the mp executor's call semantics.

Calls and replies are the same msgspec `WorkerCall`/`WorkerReply` bytes the multiprocess
executor sends; Ray only carries them. Each call gets its own object refs, so a late reply of a
failed call can never be read by the next one. A rank whose actor dies (a `RayActorError`) fails
the call with the rank's name, and a monitor thread pings idle actors so an idle engine fails
promptly too. Ray is an optional dependency: `pip install rankcast[ray]`.

Ranks are placed through a placement group with one bundle (1 CPU) per pipeline stage, so a
stage's tensor-parallel ranks share a node and stages go where `--ray-placement` says: packed on
as few nodes as fit, spread over nodes, or strictly one node each. The group belongs to the
engine core (Ray's driver): Ray removes it, and the actors, when that process ends.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

import msgspec

from rankcast import envs
from rankcast.config import EngineConfig
from rankcast.executor.base import Executor, ExecutorError, RankLostError
from rankcast.model_files.source import ModelSource
from rankcast.protocol import WorkerCall, WorkerReply

logger = logging.getLogger(__name__)

_PING_INTERVAL_S = 1.0
# A ping runs beside the rank's calls (a concurrency group of its own), so only an unreachable
# node (a dead host, a partition) leaves it unanswered this long: the rank counts as lost.
_PING_TIMEOUT_S = 2.5
# How long the engine waits for the cluster to offer its placement (a strict spread waits for
# nodes); the launcher's own start-up timeout is longer.
_PLACEMENT_TIMEOUT_S = 600.0


class RayRank:
    """The body of one rank's actor (wrapped with `ray.remote` at executor start)."""

    def __init__(self, config: EngineConfig, source: ModelSource, rank: int) -> None:
        self.config = config
        self.source = source
        self.rank = rank
        self.worker: Any = None

    def address(self) -> tuple[str, int]:
        """An address on this actor's node for torch.distributed's rendezvous (rank 0 hosts it)."""
        import ray

        # Ray's own helper is untyped; it returns the node's address as a string.
        node_address: Callable[[], str] = ray.util.get_node_ip_address
        host = node_address()
        with socket.socket() as sock:
            sock.bind(("", 0))
            return host, sock.getsockname()[1]

    def start(self, init_method: str) -> int:
        import os

        from rankcast.worker.worker import start_worker
        from rankcast.worker.worker_proc import init_distributed

        group = init_distributed(self.config, self.rank, init_method)
        # No shared-memory doorbell across machines: replies and pings carry the flag instead.
        self.worker = start_worker(self.config, self.source, self.rank, self.rank, group)
        return os.getpid()

    def call(self, frame: bytes) -> bytes:
        from rankcast.worker.worker_proc import dispatch

        call = msgspec.msgpack.decode(frame, type=WorkerCall)
        return msgspec.msgpack.encode(dispatch(self.worker, call))

    def ping(self) -> bool:
        """Alive; and True when this rank has notifications waiting (the idle doorbell)."""
        pending: bool = self.worker.notifications.pending
        return pending


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig, source: ModelSource, engine_index: int = 0) -> None:
        super().__init__(config, source, engine_index)
        try:
            import ray
        except ImportError:
            raise ExecutorError(
                "--distributed-executor-backend ray needs Ray: pip install 'rankcast[ray]'"
            ) from None
        self.ray = ray
        if not ray.is_initialized():
            ray.init(address=envs.ray_address(), log_to_driver=False)
        self.world_size = config.parallel.world_size
        self.failure: str | None = None
        self.stopping = False
        self.stopped = threading.Event()  # wakes the monitor out of its wait between pings
        self.call_ids = 0
        self.remote_doorbell = False
        self.actors: list[Any] = []
        self.placement = self._placement_group()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        # No CPU reservation per actor: a stage's ranks share its bundle's node the way the mp
        # executor's ranks share cores.
        # Pings run in a concurrency group of their own, beside the rank's calls (Ray's stubs
        # do not declare the option, hence the mapping).
        options: dict[str, Any] = {"num_cpus": 0, "concurrency_groups": {"health": 1}}
        actor_class = ray.remote(**options)(RayRank)
        tp = config.parallel.tensor_parallel_size
        # Ray actor handles: their methods are called as `.remote(...)` (untyped by Ray).
        self.actors = [
            actor_class.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement, placement_group_bundle_index=rank // tp
                )
            ).remote(config, source, rank)
            for rank in range(self.world_size)
        ]
        try:
            host, port = ray.get(self.actors[0].address.remote())
            init_method = f"tcp://{host}:{port}"
            self.pids = ray.get([actor.start.remote(init_method) for actor in self.actors])
        except Exception as exc:
            self.shutdown()
            raise ExecutorError(f"Ray ranks failed to start: {exc}") from None
        self.monitor = threading.Thread(target=self._watch_actors, name="ray-monitor", daemon=True)
        self.monitor.start()

    def _placement_group(self) -> Any:
        """One bundle per pipeline stage, placed as `--ray-placement` says; waits (bounded) for
        the cluster to offer it, naming what it waited for."""
        from ray.util.placement_group import placement_group, remove_placement_group

        strategy = self.config.parallel.ray_placement.upper().replace("-", "_")
        stages = self.config.parallel.pipeline_parallel_size
        group = placement_group([{"CPU": 1}] * stages, strategy=strategy)
        ready, _ = self.ray.wait([group.ready()], timeout=_PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(group)
            raise ExecutorError(
                f"the Ray cluster did not offer {stages} bundle(s) of 1 CPU with strategy "
                f"{strategy} in {_PLACEMENT_TIMEOUT_S:.0f} s"
            )
        return group

    def _watch_actors(self) -> None:
        while not self.stopping and self.failure is None:
            for rank, actor in enumerate(self.actors):
                if self.stopping:
                    return
                try:
                    ping = actor.ping.options(concurrency_group="health").remote()
                    if self.ray.get(ping, timeout=_PING_TIMEOUT_S):
                        self.remote_doorbell = True
                except (
                    self.ray.exceptions.RayActorError,
                    self.ray.exceptions.GetTimeoutError,
                ) as exc:
                    if self.stopping:
                        return
                    lost = isinstance(exc, self.ray.exceptions.GetTimeoutError)
                    self.failure = f"rank {rank} (Ray actor, pid {self.pids[rank]}) " + (
                        f"did not answer in {_PING_TIMEOUT_S:g} s: its node is unreachable"
                        if lost
                        else "died"
                    )
                    logger.error("worker %s", self.failure)
                    if self.failure_callback is not None:
                        self.failure_callback(self.failure)
                    return
                except Exception:
                    continue
            if self.stopped.wait(_PING_INTERVAL_S):
                return

    def _dead_rank(self, refs: list[Any]) -> str | None:
        """A collective error on a live rank is usually the echo of a peer's death: find it."""
        self.ray.wait(refs, num_returns=len(refs), timeout=5)
        for rank, ref in enumerate(refs):
            try:
                self.ray.get(ref, timeout=0)
            except self.ray.exceptions.RayActorError:
                self.failure = f"rank {rank} (Ray actor, pid {self.pids[rank]}) died"
                return self.failure
            except Exception:
                continue
        return None

    def _collective(
        self,
        name: str,
        method: str | Callable[..., Any],
        args: tuple[Any, ...],
        timeout: float | None,
        unique_reply_rank: int | None,
    ) -> list[Any]:
        ranks = range(self.world_size) if unique_reply_rank is None else [unique_reply_rank]
        return [reply.result for reply in self._call(name, args, timeout, ranks)]

    def notifications_pending(self) -> bool:
        pending, self.remote_doorbell = self.remote_doorbell, False
        return pending

    def _call(
        self,
        name: str,
        args: tuple[Any, ...],
        timeout: float | None,
        ranks: range | list[int],
    ) -> list[WorkerReply]:
        if self.failure is not None:
            raise RankLostError(self.failure)
        self.rpc_counts[name] += 1
        self.call_ids += 1
        frame = msgspec.msgpack.encode(WorkerCall(self.call_ids, name, list(args)))
        refs = [actor.call.remote(frame) for actor in self.actors]
        wanted = [refs[r] for r in ranks]
        ready, _ = self.ray.wait(wanted, num_returns=len(wanted), timeout=timeout)
        if len(ready) < len(wanted):
            missing = [r for r, ref in zip(ranks, wanted, strict=True) if ref not in ready]
            raise TimeoutError(f"{name}: no reply from rank(s) {missing} in {timeout} s")
        replies = []
        for rank, ref in zip(ranks, wanted, strict=True):
            try:
                reply = msgspec.msgpack.decode(self.ray.get(ref), type=WorkerReply)
            except self.ray.exceptions.RayActorError:
                self.failure = f"rank {rank} (Ray actor, pid {self.pids[rank]}) died"
                raise RankLostError(f"{name} failed: {self.failure}") from None
            if reply.error is not None:
                dead = self._dead_rank(refs)
                error = RankLostError if dead else ExecutorError
                cause = f"{dead}; " if dead else ""
                raise error(f"{cause}rank {rank} failed in {name}: {reply.error}")
            replies.append(reply)
        if any(reply.notifications_pending for reply in replies):
            self.remote_doorbell = True
        return replies

    def shutdown(self) -> None:
        self.stopping = True
        self.stopped.set()
        for actor in getattr(self, "actors", []):
            try:
                self.ray.kill(actor)
            except Exception:
                logger.debug("actor already gone", exc_info=True)
        # The monitor must be done with Ray before anyone shuts Ray down: a Ray call after
        # `ray.shutdown()` makes Ray's core worker end the whole process with status 1, no
        # traceback (it ended pytest after tests/executor/test_ray.py). Its ping to a killed
        # actor fails at once; a ping in flight waits at most its timeout.
        monitor = getattr(self, "monitor", None)
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join(_PING_TIMEOUT_S + 1.0)
        placement = getattr(self, "placement", None)
        if placement is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(placement)
            except Exception:
                logger.debug("placement group already gone", exc_info=True)
