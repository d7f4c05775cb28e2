"""One worker rank: device set-up, model loading, KV cache, and the step entry point.

Executors call these methods by name through `collective_rpc`, so their names are the worker's
remote interface.
"""

from __future__ import annotations

import contextlib
import logging
import time
import typing
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from rankcast import kernels, platform
from rankcast.channel.buffer import NotificationBuffer
from rankcast.channel.doorbell import Doorbell
from rankcast.channel.events import WEIGHTS_LOADED_KEY, CustomNotification, WorkerNotification
from rankcast.config import EngineConfig
from rankcast.distributed import PipelineStage, TensorParallelGroup
from rankcast.model import kv_quant
from rankcast.model.loader import load_model
from rankcast.model_files.arch import ArchConfig
from rankcast.model_files.source import ModelSource
from rankcast.process import is_rankcast_process
from rankcast.protocol import (
    RANK_CALLS,
    ApplyLoRAMoves,
    CacheAllocated,
    CacheBudget,
    ExecuteModel,
    InitializeCache,
    LoRAMove,
    NumAvailableBlocks,
    RankCall,
    SchedulerOutput,
    StepReply,
    TakeNotifications,
)
from rankcast.worker.expert_load import ExpertLoadWindow
from rankcast.worker.extension import load_worker_plugins, worker_class
from rankcast.worker.grammar import GrammarMatchers
from rankcast.worker.lora_manager import LoRAManager
from rankcast.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        rank: int = 0,
        local_rank: int = 0,
        ranks_on_this_machine: int = 1,
        tp_group: dist.ProcessGroup | None = None,
        notifications: NotificationBuffer | None = None,
    ) -> None:
        self.config = config
        # This rank's own buffer: what producers publish during its calls lands here only.
        self.notifications = notifications or NotificationBuffer(
            config.notifications.worker_notification_buffer_size, rank=rank
        )
        self.source = source
        self.rank = rank
        self.local_rank = local_rank
        self.ranks_on_this_machine = ranks_on_this_machine
        tp_size = config.parallel.tensor_parallel_size
        self.tp = TensorParallelGroup(rank=rank % tp_size, size=tp_size, group=tp_group)
        self.is_output_rank = rank == config.parallel.output_rank
        pp_size = config.parallel.pipeline_parallel_size
        pp_rank = rank // tp_size
        self.pp = PipelineStage(
            rank=pp_rank,
            size=pp_size,
            prev_rank=rank - tp_size if pp_rank > 0 else -1,
            next_rank=rank + tp_size if pp_rank < pp_size - 1 else -1,
        )
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.runner: ModelRunner | None = None
        self.loras: LoRAManager | None = None
        # A mixture of experts' tokens per expert, published a window at a time (None: dense).
        self.expert_load: ExpertLoadWindow | None = None
        self.cpus: list[int] | None = None  # the cores this rank's threads are bound to
        # The engine core's calls on this rank (`rankcast.protocol.RankCall`), one handler each.
        self.rank_call_handlers: dict[type[RankCall[Any]], Callable[[Any], Any]] = {
            NumAvailableBlocks: lambda _: self.num_available_blocks(),
            InitializeCache: lambda call: self.initialize_cache(
                call.num_blocks, call.num_window_blocks
            ),
            TakeNotifications: lambda _: self.take_notifications(),
            ApplyLoRAMoves: lambda call: self.apply_lora_moves(call.moves),
            ExecuteModel: lambda call: self.execute_model(call.batch),
        }

    def run_call(self, method: str, args: Sequence[Any]) -> Any:
        """One call on this rank, as the executor names it: the engine core's own by the table
        (arguments read as the call's struct), anything else a worker-extension method, its
        arguments given back the types its signature declares (`convert_args`)."""
        call_type = RANK_CALLS.get(method)
        if call_type is not None:
            return self.rank_call_handlers[call_type](msgspec.convert(list(args), call_type))
        fn = getattr(self, method)
        return fn(*convert_args(fn, list(args)))

    def init_device(self) -> None:
        """Pick the device and precision, and give this rank its share of the cores: threads
        capped so ranks do not oversubscribe them, and bound to them where that applies
        (`platform.cpus_for_rank`)."""
        parallel = self.config.parallel
        # An engine's ranks share this machine's GPUs, except under Ray, which may spread them
        # over machines (each rank then counts only itself here).
        ranks_here = 1 if parallel.backend == "ray" else parallel.world_size
        self.device = platform.device_for_rank(self.local_rank, ranks_here)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # The kernels first: whether they run decides what `auto` precision is fastest.
        uses_kernels = self.device.type == "cpu" and kernels.load(parallel.kernels)
        self.dtype = platform.resolve_dtype(self.config.model.dtype, self.device)
        cpus = None
        if uses_kernels:
            cpus = platform.cpus_for_rank(
                self.local_rank,
                self.ranks_on_this_machine,
                is_rankcast_process(),
                parallel.cpu_bind,
                parallel.num_threads,
            )
        if cpus:
            torch.set_num_threads(len(cpus))
            torch.ops.rankcast.bind_threads(cpus)
            logger.info("rank %d: %d threads bound to CPUs %s", self.rank, len(cpus), cpus)
        else:
            threads = platform.threads_per_rank(self.ranks_on_this_machine, parallel.num_threads)
            torch.set_num_threads(threads)
        self.cpus = cpus
        torch.manual_seed(self.config.model.seed)

    def load_model(self) -> float:
        """Load this rank's shard and publish how long it took: with several ranks, the slowest
        shard sets the start-up time, and only a per-rank figure shows which one it is."""
        start = time.perf_counter()
        arch = ArchConfig.from_model_dir(self.source.model_dir)
        model = load_model(
            self.source.model_dir,
            arch,
            self.dtype,
            self.device,
            self.tp,
            self.pp,
            weight_snapshots=self.config.model.weight_snapshots,
            snapshot_cache_gib=self.config.model.weight_snapshot_cache_gib,
            linear_kernel=self.config.parallel.linear_kernel,
            quantization=self.source.quantization(self.config.model.quantization),
            expert_parallel=self.config.parallel.enable_expert_parallel,
        )
        grammars = GrammarMatchers(self.source.model_dir, arch.vocab_size, arch.eos_token_ids)
        self.runner = ModelRunner(
            model,
            arch,
            self.config.cache.block_size,
            self.device,
            self.dtype,
            grammars,
            kv_quant.cache_dtype(self.config.cache.kv_cache_dtype, self.dtype),
        )
        self.expert_load = ExpertLoadWindow.for_model(model, self.notifications.publish)
        if self.config.lora.enable_lora:
            lora = self.config.lora
            self.runner.enable_lora(lora.max_loras, lora.max_lora_rank)
            self.loras = LoRAManager(
                self.runner, arch, lora.max_lora_rank, self.notifications.publish
            )
        seconds = time.perf_counter() - start
        size = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        logger.info("rank %d loaded its shard in %.2f s (%s)", self.rank, seconds, self.dtype)
        self.notifications.publish(
            CustomNotification(key=WEIGHTS_LOADED_KEY, payload={"bytes": size, "seconds": seconds})
        )
        return seconds

    # ---- LoRA: the engine core decides each move; this rank's manager makes and reports it.
    # Moves ride the step (SchedulerOutput.lora_moves) or a utility's call (apply_lora_moves).

    def _lora(self) -> LoRAManager:
        if self.loras is None:
            raise RuntimeError("LoRA is not enabled on this engine (--enable-lora)")
        return self.loras

    def apply_lora_moves(self, moves: list[LoRAMove]) -> None:
        """Make the engine's adapter moves on this rank, in order (a utility's, at once)."""
        self._lora().apply(moves)

    def close(self) -> None:
        """Stop this rank's background work (the KV cache's commit, adapter reads in flight)
        before the process or the executor lets go of it."""
        if self.loras is not None:
            self.loras.close()
        if self.expert_load is not None:
            self.expert_load.close()
        if self.runner is not None:
            self.runner.close()

    def take_notifications(self) -> list[WorkerNotification] | None:
        """Drain this rank's notification buffer (None, allocating nothing, when empty)."""
        return self.notifications.take()

    def num_available_blocks(self) -> CacheBudget:
        """This rank's KV-cache budget and what a block of each KV-cache group costs it (the
        engine sizes the pools so every rank's fit)."""
        assert self.runner is not None
        budget = int(self.config.cache.space_gib * 2**30)
        return CacheBudget(budget, self.runner.bytes_per_block(0), self.runner.bytes_per_block(1))

    def initialize_cache(self, num_blocks: int, num_window_blocks: int = 0) -> CacheAllocated:
        """Allocate this rank's KV cache, its memory committed before the first step unless told
        not to (`ModelRunner.initialize_cache`): the bytes committed and what the cache holds."""
        assert self.runner is not None
        runner = self.runner
        committed = runner.initialize_cache(num_blocks, self.config.cache.commit, num_window_blocks)
        return CacheAllocated(committed, kv_quant.dtype_name(runner.kv_cache_dtype))

    def execute_model(self, batch: SchedulerOutput) -> StepReply:
        """The step's adapter moves first (a request admitted this step may need the slot),
        then the batch (a step may carry only moves); the reply carries what this rank
        published so far, so a busy engine needs no gather call of its own."""
        assert self.runner is not None
        if batch.lora_moves:
            self._lora().apply(batch.lora_moves)
        output = None
        if batch.sequences or batch.finished_request_ids:
            counted = self.expert_load.step() if self.expert_load else contextlib.nullcontext()
            with counted:
                output = self.runner.execute_model(batch, sample=self.is_output_rank)
        # Events first: a read is recorded before its event is published, so a read whose
        # event this reply carries is in it too.
        notifications = self.notifications.take()
        reads = None if self.loras is None else self.loras.take_finished_reads()
        return StepReply(output, notifications, reads)

    def rank_info(self) -> tuple[int, int, int]:
        """(rank, pp_rank, tp_rank): lets the engine and tests see the layout each rank holds."""
        return self.rank, self.pp.rank, self.tp.rank


def convert_args(fn: Callable[..., Any], args: list[Any]) -> list[Any]:
    """Give typed parameters their declared types back (msgpack carries a struct as an array,
    a list of structs as a list of arrays)."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        return args
    names = [n for n in fn.__code__.co_varnames[: fn.__code__.co_argcount] if n != "self"]
    converted = []
    for name, value in zip(names, args, strict=False):
        hint = hints.get(name, Any)
        if hint is not Any:
            # A type msgspec cannot build (a callable, say) is passed as it came.
            with contextlib.suppress(TypeError):
                value = msgspec.convert(value, hint)
        converted.append(value)
    return converted + args[len(converted) :]


def start_worker(
    config: EngineConfig,
    source: ModelSource,
    rank: int = 0,
    local_rank: int = 0,
    tp_group: dist.ProcessGroup | None = None,
    doorbell: Doorbell | None = None,
) -> Worker:
    """Build this rank's worker (with any extension), load its shard, run the plugins.

    The notification buffer comes first, so load-time events are kept and ring the doorbell
    like any other; it is the current one while the plugins run.
    """
    notifications = NotificationBuffer(
        config.notifications.worker_notification_buffer_size, doorbell, rank
    )
    notifications.register()
    try:
        with notifications.current():
            cls = worker_class(Worker, config.parallel.worker_extension_cls)
            worker: Worker = cls(
                config,
                source,
                rank,
                local_rank,
                config.parallel.ranks_on_this_machine,
                tp_group=tp_group,
                notifications=notifications,
            )
            worker.init_device()
            worker.load_model()
            load_worker_plugins(worker)
    except BaseException:
        notifications.unregister()
        raise
    return worker
