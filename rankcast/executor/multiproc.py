"""One spawned process per rank on this machine, reached over ZMQ.

`collective_rpc` sends the same `WorkerCall` to every rank and waits, against one deadline, for
the replies it asked for. Every call carries a fresh `call_id` and every reply echoes it; a reply
whose id is not the current call's is discarded. That is how a failed or timed-out collective
leaves nothing behind for the next one: its late replies arrive tagged with an old id.
A monitor thread watches each rank's process; a rank that dies fails the current and every later
call at once, naming the rank.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

import msgspec
import zmq

from rankcast.channel.doorbell import Doorbell
from rankcast.config import EngineConfig
from rankcast.executor.base import Executor, ExecutorError, RankLostError
from rankcast.model_files.source import ModelSource
from rankcast.process import private_ipc_dir
from rankcast.protocol import SHUTDOWN, WorkerCall, WorkerReply
from rankcast.worker.rank_entry import rank_process

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 900.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _spawn_hint() -> str:
    """What to change when the likely cause of a rank's early death is how the caller's code
    runs: ranks are spawned, and each re-imports the caller's main module first."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None:  # python -c, or an interactive session: nothing is re-imported
        return ""
    if not os.path.isfile(path):
        return (
            f"; ranks are spawned processes that re-import the main module, and {path} cannot "
            "be: run the code from a file, with the LLM created under "
            '`if __name__ == "__main__":`, or with python -c'
        )
    return (
        f"; ranks are spawned processes that re-import {path}: if it creates the LLM at module "
        'level, put that code under `if __name__ == "__main__":`'
    )


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, source: ModelSource, engine_index: int = 0) -> None:
        super().__init__(config, source, engine_index)
        self.world_size = config.parallel.world_size
        self.stopping = False
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.call_ids = itertools.count()
        self.failure: str | None = None
        self.stale_replies = 0
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(WorkerReply)
        self.ipc_dir = private_ipc_dir("rankcast-workers")
        self.context = zmq.Context()
        self.calls: list[zmq.Socket[bytes]] = []
        try:
            self._start_ranks(config, source, engine_index)
        except BaseException:
            # Whatever failed (a rank's start, or spawning itself: a main module without a
            # __main__ guard re-creates the LLM inside each rank), leave no socket directory.
            self.shutdown()
            raise
        self.monitor = threading.Thread(target=self._watch_ranks, name="rank-monitor", daemon=True)
        self.monitor.start()

    def _start_ranks(self, config: EngineConfig, source: ModelSource, engine_index: int) -> None:
        """Bind the call and reply sockets, spawn one process per rank, wait until all load."""
        base = self.ipc_dir
        self.replies = self.context.socket(zmq.PULL)
        self.replies.bind(f"ipc://{base}/replies")
        for rank in range(self.world_size):
            sock = self.context.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(f"ipc://{base}/calls{rank}")
            self.calls.append(sock)
        spawn = multiprocessing.get_context("spawn")
        self.doorbell = Doorbell.create(self.world_size, spawn)
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        pipes = []
        for rank in range(self.world_size):
            read, write = spawn.Pipe(duplex=False)
            proc = spawn.Process(
                target=rank_process,
                args=(
                    config,
                    source,
                    engine_index,
                    rank,
                    init_method,
                    f"ipc://{base}/calls{rank}",
                    f"ipc://{base}/replies",
                    self.doorbell,
                    write,
                ),
                name=f"worker_rank{rank}",
            )
            proc.start()
            write.close()
            self.procs.append(proc)
            pipes.append(read)
        self._wait_ready(pipes)

    def _wait_ready(self, pipes: list[Connection]) -> None:
        """Wait for every rank's "ready"; any rank's death fails the wait at once, not only
        the death of the rank being waited for (its peers may be stuck waiting for the dead
        one in a collective)."""
        deadline = time.monotonic() + _START_TIMEOUT_S
        for rank, pipe in enumerate(pipes):
            while not pipe.poll(0.2):
                dead = self._dead_rank()
                if dead is not None:
                    raise RankLostError(f"during start-up, {dead}{_spawn_hint()}")
                if time.monotonic() > deadline:
                    raise ExecutorError(f"rank {rank} did not start in {_START_TIMEOUT_S:.0f} s")
            try:
                kind, *detail = pipe.recv()
            except EOFError:  # it died before a word
                self.procs[rank].join(5)
                raise RankLostError(
                    f"rank {rank} exited during start-up (exit code {self.procs[rank].exitcode})"
                    f"{_spawn_hint()}"
                ) from None
            if kind != "ready":
                raise ExecutorError(f"rank {rank} failed to start: {detail[0] if detail else kind}")

    def _dead_rank(self) -> str | None:
        """Describe the first rank whose process has exited, if any. A process closes its
        sentinel as it exits, a moment before the kernel reports it exited (`is_alive` is still
        true then): a ready sentinel counts, and `join` waits out that moment."""
        ended = set(wait([proc.sentinel for proc in self.procs], timeout=0))
        for rank, proc in enumerate(self.procs):
            if proc.sentinel in ended or not proc.is_alive():
                proc.join(1)
                return f"rank {rank} (pid {proc.pid}) died with exit code {proc.exitcode}"
        return None

    def _watch_ranks(self) -> None:
        wait([proc.sentinel for proc in self.procs])
        if self.stopping:
            return
        self.failure = self._dead_rank() or "a rank exited"
        logger.error("worker %s", self.failure)
        if self.failure_callback is not None:
            self.failure_callback(self.failure)

    def _collective(
        self,
        name: str,
        method: str | Callable[..., Any],
        args: tuple[Any, ...],
        timeout: float | None,
        unique_reply_rank: int | None,
    ) -> list[Any]:
        if self.failure is not None:
            raise RankLostError(self.failure)
        self.rpc_counts[name] += 1
        call_id = next(self.call_ids)
        reply_rank = -1 if unique_reply_rank is None else unique_reply_rank
        frame = self.encoder.encode(WorkerCall(call_id, name, list(args), reply_rank))
        for sock in self.calls:
            sock.send(frame, copy=False)
        expected = set(range(self.world_size)) if unique_reply_rank is None else {unique_reply_rank}
        results: dict[int, Any] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while expected - results.keys():
            if not self.replies.poll(100):
                if self.failure is not None:
                    raise RankLostError(f"{name} failed: {self.failure}")
                if deadline is not None and time.monotonic() > deadline:
                    missing = sorted(expected - results.keys())
                    raise TimeoutError(f"{name}: no reply from rank(s) {missing} in {timeout} s")
                continue
            reply = self.decoder.decode(self.replies.recv())
            if reply.call_id != call_id:
                self.stale_replies += 1  # a late answer to an earlier, failed call
                continue
            if reply.error is not None:
                # A collective error on a live rank is usually the echo of a peer's death;
                # name the dead rank first, since that is the cause an operator must see.
                dead = self._dead_rank()
                error = RankLostError if dead else ExecutorError
                cause = f"{dead}; " if dead else ""
                raise error(f"{cause}rank {reply.rank} failed in {name}: {reply.error}")
            results[reply.rank] = reply.result
        return [results[r] for r in sorted(expected)]

    def notifications_pending(self) -> bool:
        return self.doorbell.take()

    def shutdown(self) -> None:
        self.stopping = True
        frame = self.encoder.encode(WorkerCall(-1, SHUTDOWN))
        for sock, proc in zip(self.calls, self.procs, strict=False):
            if proc.is_alive():
                with contextlib.suppress(zmq.ZMQError):
                    sock.send(frame, flags=zmq.NOBLOCK)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(2)
        self.context.destroy(linger=0)
        for path in self.ipc_dir.glob("*"):
            path.unlink(missing_ok=True)
        self.ipc_dir.rmdir()
