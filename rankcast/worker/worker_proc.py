"""A worker rank as its own process: join torch.distributed, load the shard, serve RPCs.

Calls arrive on this rank's own ZMQ socket as `WorkerCall`s; replies go back on the executor's
shared reply socket tagged with the call id, so the executor can tell a current reply from a
stale one.
"""

from __future__ import annotations

import importlib
import logging
import signal
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import torch
import torch.distributed as dist
import zmq

from rankcast.channel.doorbell import Doorbell
from rankcast.config import EngineConfig
from rankcast.logger import init_logging
from rankcast.model_files.source import ModelSource
from rankcast.process import TeardownSkip, die_with_parent, set_process_title
from rankcast.protocol import SHUTDOWN, WorkerCall, WorkerReply
from rankcast.startup_gc import collector_paused, freeze_startup_heap
from rankcast.worker.worker import Worker, start_worker

logger = logging.getLogger(__name__)


def resolve_callable(name: str) -> Callable[..., Any]:
    """`module:qualname` -> the function, for collective RPCs that are not Worker methods."""
    module, _, qualname = name.partition(":")
    target: Any = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"{name} is not callable")
    function: Callable[..., Any] = target
    return function


def dispatch(worker: Worker, call: WorkerCall) -> WorkerReply:
    """Run one call on this rank; any exception becomes an error reply with its traceback."""
    reply = WorkerReply(call.call_id, worker.rank)
    try:
        with worker.notifications.current():
            if ":" in call.method:
                reply.result = resolve_callable(call.method)(worker, *call.args)
            else:
                reply.result = worker.run_call(call.method, call.args)
    except Exception as exc:
        reply.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    reply.notifications_pending = worker.notifications.pending
    return reply


def init_distributed(config: EngineConfig, rank: int, init_method: str) -> dist.ProcessGroup:
    """Join the world, then build every TP group (all ranks must create each, in order)."""
    parallel = config.parallel
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=parallel.world_size
    )
    mine: dist.ProcessGroup | None = None
    tp = parallel.tensor_parallel_size
    for stage in range(parallel.pipeline_parallel_size):
        ranks = list(range(stage * tp, (stage + 1) * tp))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    assert mine is not None
    return mine


def run_worker(
    config: EngineConfig,
    source: ModelSource,
    engine_index: int,
    rank: int,
    init_method: str,
    call_address: str,
    reply_address: str,
    doorbell: Doorbell,
    ready: Connection,
) -> None:
    teardown = TeardownSkip()
    tp = config.parallel.tensor_parallel_size
    role = f"worker_dp{engine_index}_pp{rank // tp}_tp{rank % tp}"
    set_process_title(role)
    init_logging(role)
    die_with_parent()
    # Ctrl-C reaches the whole process group; the engine core decides when ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        group = init_distributed(config, rank, init_method)
        # Data-parallel engine cores share the machine: each rank's local index is machine-wide.
        local_rank = engine_index * config.parallel.world_size + rank
        with collector_paused():  # the model lives as long as the process
            worker = start_worker(
                config, source, rank, local_rank, tp_group=group, doorbell=doorbell
            )
    except Exception as exc:
        logger.exception("rank %d failed to start", rank)
        ready.send(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    context = zmq.Context()
    calls = context.socket(zmq.PULL)
    calls.connect(call_address)
    replies = context.socket(zmq.PUSH)
    replies.connect(reply_address)
    freeze_startup_heap()
    ready.send(("ready",))
    ready.close()
    decoder = msgspec.msgpack.Decoder(WorkerCall)
    encoder = msgspec.msgpack.Encoder()
    while True:
        call = decoder.decode(calls.recv())
        if call.method == SHUTDOWN:
            break
        reply = dispatch(worker, call)
        if call.reply_rank in (-1, rank):
            replies.send(encoder.encode(reply))
    worker.close()
    context.destroy(linger=0)
    if dist.is_initialized():
        dist.destroy_process_group()
    teardown.finished()  # the engine core waits for its ranks: ~0.8 s less for every stop
