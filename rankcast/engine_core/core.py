"""The engine core: owns the scheduler, the executor and the notification channel's sequence.

It decides everything about a step and about who gets which message; the process around it
(`core_proc.py`) and the offline engine's in-process client only move what it returns. The
notification channel's rules are carried out by the functions docs/architecture.md names, one
each, mostly in `rankcast/channel/`; here the core calls them at its moments:

    start()          rule 5 at start: gather the load-time events
    call_utility()   rule 5 after a utility that changes a producer (`CHANGES_PRODUCERS`)
    step()           rule 4 on each rank's step reply, rule 5 after a step, rules 6-7
    idle_outputs()   rule 5 when idle (doorbell, poll), rules 6-7 (a notification-only message)
    _broadcast()     rule 7: every connected client gets every batch, in the same order;
                     request outputs go only to the client whose request they are
    snapshot()       rule 8: the state the stream continues after (in the handshake's reply)

The offline `LLM` drives it in-process (client 0); the engine-core process wraps it in ZMQ
threads that only move bytes: each call here returns the messages to send, per client.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import msgspec

from rankcast.channel.events import KVCacheEvent
from rankcast.channel.gather import EngineNotificationChannel, GatherError, Moment
from rankcast.channel.snapshot import EngineStateSnapshot
from rankcast.channel.view import EngineView, LoRAShape
from rankcast.config import ConfigError, EngineConfig
from rankcast.engine_core.block_manager import BlockManager
from rankcast.engine_core.kv_cache_manager import (
    KVCacheManager,
    KVCacheSplit,
    split_cache,
    window_pool_cap,
)
from rankcast.engine_core.lora_registry import LoRARegistry, startup_share
from rankcast.engine_core.request import Request
from rankcast.engine_core.scheduler import Scheduler
from rankcast.errors import ClientError, ExtensionCallError, UnknownMethodError
from rankcast.executor.base import ExecutorError
from rankcast.executor.factory import create_executor
from rankcast.model_files.arch import ArchConfig
from rankcast.model_files.source import ModelSource
from rankcast.protocol import (
    PROTOCOL_VERSION,
    UTILITIES,
    AbortRequests,
    AddLoRA,
    ClientHello,
    CollectiveRPC,
    EngineCoreInput,
    EngineCoreMessage,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    ErrorKind,
    FinishReason,
    GetStats,
    InitializeCache,
    ListLoRAs,
    NumAvailableBlocks,
    Ping,
    PinLoRA,
    R,
    RemoveLoRA,
    ResetPrefixCache,
    SchedulerStats,
    Snapshot,
    Utility,
    UtilityOutput,
    UtilityRequest,
)
from rankcast.worker.extension import import_class

logger = logging.getLogger(__name__)

# Messages for clients, in the order they must be sent: (client index, message).
Outbox = list[tuple[int, EngineCoreMessage]]
# The longest an idle engine waits for input before it looks at its ranks again.
IDLE_WAIT_S = 1.0


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        engine_index: int = 0,
        incarnation: int = 0,
    ) -> None:
        self.config = config
        self.engine_index = engine_index
        self.incarnation = incarnation  # which start of this engine core, under a supervisor
        self.arch = ArchConfig.from_model_dir(source.model_dir)
        self.eos_token_ids = frozenset(self.arch.eos_token_ids)
        self.executor = create_executor(config, source, engine_index)
        try:
            self._start()
        except BaseException:
            # Ranks are separate processes: a failed start must not leave them behind.
            self.executor.shutdown()
            raise

    def _start(self) -> None:
        """Everything after the ranks are up: cache, scheduler, notification channel."""
        config = self.config
        block_size = config.cache.block_size
        split = self._size_kv_cache()
        num_blocks = split.full_blocks or split.window_blocks
        self.max_model_len = self._resolve_max_model_len(num_blocks * block_size)
        allocated = self.executor.call(InitializeCache(num_blocks, split.window_blocks))
        self.kv_cache_committed_bytes = sum(a.committed_bytes for a in allocated)
        # Every rank resolves --kv-cache-dtype against the same model dtype.
        self.kv_cache_dtype = allocated[0].kv_cache_dtype
        if self.kv_cache_committed_bytes:
            logger.info(
                "KV cache: %.0f MiB over %d rank(s), committed before the first step "
                "(RANKCAST_KV_CACHE_COMMIT=0 leaves it to first use)",
                self.kv_cache_committed_bytes / 2**20,
                config.parallel.world_size,
            )
        self.notifications = EngineNotificationChannel(
            self.executor,
            self.engine_index,
            config.parallel.tensor_parallel_size,
            config.notifications,
        )
        self.extension_methods = self._extension_methods()
        self.utility_handlers = self._utility_handlers()
        self.loras = None
        self._lora_request_sets: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
        self._lora_requests_changed_at = time.time()
        if config.lora.enable_lora:
            self.loras = LoRARegistry(
                self.executor,
                self.arch,
                config.lora,
                self._requests_using_adapter,
                self._running_adapters,
                config.parallel.world_size,
            )
        self.scheduler = Scheduler(
            config.scheduler,
            self._kv_cache_manager(num_blocks, split),
            self.max_model_len,
            self.loras,
            config.lora.lora_turn_steps,
        )
        if self.loras is not None:
            for name, path in config.lora.lora_modules:
                self.loras.add(name, path)
            names = [name for name, _ in config.lora.lora_modules]
            dp = config.parallel.data_parallel_size
            self.loras.start_with(startup_share(names, self.engine_index % dp, dp))
        self.stalled = False
        # Clients that completed the handshake: each gets every notification batch and stats.
        self.clients: set[int] = set()
        self.last_stats: SchedulerStats | None = None
        # Called with every flushed batch (the ZMQ event stream publishes from here).
        self.flush_sinks: list[Callable[[list[msgspec.Raw]], None]] = []
        # Called with every step's KV-cache events (the vLLM-format publisher is one).
        self.kv_event_sinks: list[Callable[[list[KVCacheEvent]], None]] = []
        # The engine as its events describe it, applied as each leaves: the catch-up snapshot.
        lora = config.lora
        self.view = EngineView(
            self.engine_index,
            self.incarnation,
            LoRAShape(config.parallel.world_size, lora.max_loras, lora.host_capacity)
            if lora.enable_lora
            else None,
            block_size if config.cache.kv_events else None,
        )
        self.notifications.observers.append(self.view.apply)
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens), %s; max_model_len %d",
            num_blocks,
            block_size,
            num_blocks * block_size,
            self.kv_cache_dtype,
            self.max_model_len,
        )
        spec = config.scheduler.speculative_config
        if spec is not None:
            logger.info(
                "speculative decoding: %s, up to %d drafted tokens a request and step, as many "
                "as the measured step cost says pay",
                spec.method,
                spec.max_draft_tokens,
            )
        if split.window_blocks:
            logger.info(
                "KV cache of the sliding-window layers: %d blocks of their own (a window of %d "
                "tokens; blocks behind it are handed back)",
                split.window_blocks,
                self.arch.group_windows()[1],
            )

    def _size_kv_cache(self) -> KVCacheSplit:
        """The pools of the model's KV-cache groups, sized from every rank's budget
        (kv_cache_manager.py): one pool where the model has one group, else the windowed
        group's sized for its window and the full group's taking the rest. An explicit
        `cache.num_blocks` gives every group that many."""
        windows = self.arch.group_windows()
        given = self.config.cache.num_blocks
        if given is not None:
            return KVCacheSplit(given, given if len(windows) == 2 else 0)
        budgets = [
            (b.budget_bytes, b.full_block_bytes, b.window_block_bytes)
            for b in self.executor.call(NumAvailableBlocks())
        ]
        if len(windows) == 1:  # one group: every layer's cache in it
            return KVCacheSplit(max(1, min(b // (f + w) for b, f, w in budgets)), 0)
        scheduler = self.config.scheduler
        cap = window_pool_cap(
            windows[1],
            self.config.cache.block_size,
            scheduler.max_num_seqs,
            scheduler.max_num_batched_tokens
            if scheduler.enable_chunked_prefill
            else self.arch.max_position_embeddings,
        )
        return split_cache(budgets, cap)

    def _kv_cache_manager(
        self, num_blocks: int, split: KVCacheSplit
    ) -> BlockManager | KVCacheManager:
        """The block manager of each KV-cache group, as one (kv_cache_manager.py)."""
        cache = self.config.cache
        windows = self.arch.group_windows()
        first = BlockManager(
            num_blocks,
            cache.block_size,
            cache.enable_prefix_caching,
            cache.block_events,
            window=windows[0],
        )
        if len(windows) == 1:
            return first
        windowed = BlockManager(
            split.window_blocks,
            cache.block_size,
            cache.enable_prefix_caching,
            cache.block_events,
            window=windows[1],
            group=1,
        )
        return KVCacheManager(first, windowed)

    def _resolve_max_model_len(self, cache_tokens: int) -> int:
        """The model's context unless the user asks for less; never more than the cache holds."""
        wanted = self.config.model.max_model_len
        if wanted is not None and wanted > self.arch.max_position_embeddings:
            raise ConfigError(
                f"--max-model-len {wanted} exceeds the model's context "
                f"({self.arch.max_position_embeddings})"
            )
        if wanted is not None and wanted > cache_tokens:
            raise ConfigError(
                f"--max-model-len {wanted} does not fit the KV cache ({cache_tokens} tokens); "
                "raise --kv-cache-space or lower --max-model-len"
            )
        return wanted or min(self.arch.max_position_embeddings, cache_tokens)

    # ---- the sequence ----

    def start(self) -> None:
        """Rule 5 at start: load-time events (each rank's weight-load figure) were published
        before any client could ask; gather them once, they leave with the first message. The
        incarnation's first KV-cache event (the cache is empty) leaves now too."""
        self.notifications.collect(Moment.START)
        self._take_kv_events()

    def ready_info(self, client: int, hello: ClientHello) -> EngineReady:
        """Answer a client's hello: refuse another protocol version naming both; otherwise
        connect it (aborting what it sent before a restart) and hand it the snapshot its
        stream continues after."""
        if hello.protocol_version != PROTOCOL_VERSION:
            error = (
                f"protocol version mismatch: engine core speaks {PROTOCOL_VERSION}, "
                f"API server {client} speaks {hello.protocol_version}; run the same rankcast "
                "version on both"
            )
            logger.error(error)
            return EngineReady(PROTOCOL_VERSION, self.engine_index, pid=os.getpid(), error=error)
        self._forget_client_requests(client)
        self.clients.add(client)
        blocks = self.scheduler.blocks
        return EngineReady(
            PROTOCOL_VERSION,
            self.engine_index,
            self.max_model_len,
            blocks.num_blocks,
            blocks.block_size,
            pid=os.getpid(),
            # Taken between flushes: the stream that follows starts exactly where it ends.
            snapshot=self.snapshot(),
        )

    def _forget_client_requests(self, client: int) -> None:
        """A (re)connecting client has no stream for requests it sent before: abort them."""
        orphans = [
            r.request_id for r in self.scheduler.unfinished_requests() if r.client_index == client
        ]
        if orphans:
            logger.warning(
                "API server %d reconnected; aborting its %d old requests", client, len(orphans)
            )
            self.abort_requests(orphans)

    def handle(self, client: int, message: EngineCoreInput) -> Outbox:
        """One message from client `client`; returns what must be sent because of it."""
        if isinstance(message, ClientHello):
            ready = self.ready_info(client, message)
            if ready.error:
                return [(client, ready)]
            return [(client, ready), (client, self._stats_message(self.stats()))]
        if client not in self.clients:
            return []  # not connected: nowhere to answer
        if isinstance(message, EngineCoreRequest):
            try:
                self.add_request(message, client)
            except ValueError as exc:
                # The frontend validates first; if it did not, end the request with the error.
                logger.warning("rejected request %s: %s", message.request_id, exc)
                rejected = EngineCoreOutput(
                    message.request_id, [], finish_reason=FinishReason.ABORT, error=str(exc)
                )
                return [(client, EngineCoreOutputs(self.engine_index, outputs=[rejected]))]
            return []
        if isinstance(message, AbortRequests):
            self.abort_requests(message.request_ids)
            return []
        reply = self._run_utility(message)
        # Events the utility caused reach every client before the caller hears back.
        outbox: Outbox = list(self._broadcast(self._flush(), None).items())
        outbox.append((client, EngineCoreOutputs(self.engine_index, utility_output=reply)))
        return outbox

    def _run_utility(self, request: UtilityRequest) -> UtilityOutput:
        """A client's error comes back with its kind; anything else is the engine's own bug:
        logged with its traceback and answered as `internal`."""
        try:
            result = self.call_utility(self.read_utility(request))
            return UtilityOutput(request.call_id, result=result)
        except GatherError:
            raise  # a rank failed under the channel: the engine stops, loudly
        except ClientError as exc:
            return UtilityOutput(request.call_id, error=str(exc), error_kind=exc.kind)
        except Exception as exc:
            logger.exception("utility %s failed", request.method)
            return UtilityOutput(
                request.call_id,
                error=f"{type(exc).__name__}: {exc}",
                error_kind=ErrorKind.INTERNAL,
            )

    def step(self) -> dict[int, EngineCoreOutputs]:
        """Schedule, execute and account for one step (the ranks' events ride their step
        replies, rule 4's `receive`); each client gets its own requests' outputs, and all of
        them the stats and the same batch of events."""
        batch = self.scheduler.schedule()
        # Nothing could run (requests wait for an adapter being read): the driver may wait for
        # input or the doorbell instead of stepping again at once.
        self.stalled = not batch.sequences
        outputs: list[tuple[int, EngineCoreOutput]] = []
        stepped = bool(batch.sequences or batch.finished_request_ids or batch.lora_moves)
        if not stepped and self.loras is not None and self.loras.reads_in_flight():
            # Requests wait for an adapter being read: when a rank rang (or the poll is due),
            # an empty step brings every rank's finished reads, and its events with them.
            stepped = self.notifications.should_gather(Moment.IDLE)
        if stepped:
            # Finished ids and adapter moves must reach the ranks even on an empty step.
            started = time.perf_counter()
            result = self.executor.execute_model(batch)
            self.scheduler.record_step_time(batch, time.perf_counter() - started)
            # Each rank's events came back with its reply to the step.
            self.notifications.receive(result.notifications)
            if self.loras is not None:
                self.loras.update_from_reads(result.adapter_reads)
            if result.output is not None:
                outputs = self.scheduler.update_from_output(result.output)
        outputs.extend(self.scheduler.take_rejected())
        self._take_kv_events()
        self.notifications.collect(Moment.STEP if stepped else Moment.IDLE)
        flushed = self._flush()
        stats = self.last_stats = self.stats()
        return self._broadcast(flushed, stats, outputs)

    def idle_outputs(self) -> dict[int, EngineCoreOutputs] | None:
        """No step ran: rule 5 when idle (doorbell, poll), then rule 6: a notification-only
        message to every client if anything was gathered, with the stats if they changed."""
        self.notifications.collect(Moment.IDLE)
        stats = self.stats()
        changed = stats != self.last_stats
        self.last_stats = stats
        return self._broadcast(self._flush(), stats if changed else None) or None

    def idle_timeout(self) -> float:
        """How long an idle driver may wait for input before calling `idle_outputs` again."""
        return self.notifications.idle_wait(IDLE_WAIT_S)

    def _flush(self) -> list[msgspec.Raw] | None:
        """The channel's flush (rule 6), handed to the machine stream's sinks as well."""
        raws = self.notifications.flush()
        if raws:
            for sink in self.flush_sinks:
                sink(raws)
        return raws

    def _broadcast(
        self,
        notifications: list[msgspec.Raw] | None,
        stats: SchedulerStats | None,
        outputs: list[tuple[int, EngineCoreOutput]] | None = None,
    ) -> dict[int, EngineCoreOutputs]:
        """Rule 7: one message per connected client, each with the same batch of events (and
        stats), in client order; a request's outputs only in its own client's. With no step
        outputs, nothing at all when there are neither events nor stats."""
        if outputs is None and notifications is None and stats is None:
            return {}
        per_client: dict[int, list[EngineCoreOutput]] = {c: [] for c in sorted(self.clients)}
        for client, output in outputs or ():
            mine = per_client.get(client)
            if mine is not None:  # a client that went away has no stream to write to
                mine.append(output)
        now = time.time()
        return {
            client: EngineCoreOutputs(
                self.engine_index,
                outputs=mine,
                scheduler_stats=stats,
                timestamp=now,
                finished_requests=[o.request_id for o in mine if o.finished] or None,
                engine_notifications=notifications,
            )
            for client, mine in per_client.items()
        }

    def _stats_message(self, stats: SchedulerStats) -> EngineCoreOutputs:
        return EngineCoreOutputs(self.engine_index, scheduler_stats=stats, timestamp=time.time())

    # ---- requests ----

    def add_request(self, request: EngineCoreRequest, client: int | None = None) -> None:
        """Queue a tokenized request for `client` (by default the one the request names);
        length limits were checked by the frontend."""
        params = request.sampling_params
        prompt_len = len(request.prompt_token_ids)
        if prompt_len == 0:
            raise ValueError("the prompt is empty")
        if prompt_len >= self.max_model_len:
            raise ValueError(
                f"the prompt has {prompt_len} tokens, but the maximum context length is "
                f"{self.max_model_len} tokens (prompt plus at least one generated token)"
            )
        if request.lora_name is not None:
            if self.loras is None:
                raise ValueError(
                    f"request names LoRA adapter {request.lora_name!r}, but LoRA is not enabled"
                )
            self.loras.check_servable(request.lora_name)
            lora_id = self.loras.adapters[request.lora_name].adapter_id
        else:
            lora_id = 0
        room = self.max_model_len - prompt_len
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        self.scheduler.add_request(
            Request(
                request_id=request.request_id,
                prompt_token_ids=list(request.prompt_token_ids),
                params=params,
                max_tokens=max_tokens,
                eos_token_ids=self.eos_token_ids,
                arrival_time=request.arrival_time or time.time(),
                client_index=request.client_index if client is None else client,
                lora_name=request.lora_name,
                lora_id=lora_id,
                routing_reason=request.routing_reason,
                routing_expected_prefix_tokens=request.routing_expected_prefix_tokens,
            )
        )

    def _requests_using_adapter(self, name: str) -> int:
        return sum(1 for r in self.scheduler.unfinished_requests() if r.lora_name == name)

    def _running_adapters(self) -> set[str]:
        return self.scheduler.adapters_in_flight()

    def _lora_registry(self) -> LoRARegistry:
        if self.loras is None:
            raise ClientError("LoRA is not enabled on this engine (--enable-lora)")
        return self.loras

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def _extension_methods(self) -> frozenset[str]:
        """The worker extension's public methods: all a client may call on the ranks."""
        spec = self.config.parallel.worker_extension_cls
        if spec is None:
            return frozenset()
        cls = import_class(spec)
        return frozenset(
            name for name in vars(cls) if not name.startswith("_") and callable(getattr(cls, name))
        )

    # ---- utilities: one request struct per verb (rankcast/protocol.py), one handler each ----

    def _utility_handlers(self) -> dict[type[Utility[Any]], Callable[[Any], Any]]:
        """The engine core's dispatch table: every utility's handler, by its request type."""
        return {
            Ping: lambda _: "pong",
            GetStats: lambda _: self.stats(),
            Snapshot: lambda _: self.snapshot(),
            CollectiveRPC: self._collective_rpc,
            AddLoRA: lambda r: self._lora_registry().add(r.name, r.path),
            RemoveLoRA: lambda r: self._lora_registry().remove(r.name),
            PinLoRA: lambda r: self._lora_registry().pin(r.name, r.pinned),
            ListLoRAs: lambda _: self._lora_registry().list(),
            ResetPrefixCache: lambda _: self.reset_prefix_cache(),
        }

    def call_utility(self, utility: Utility[R]) -> R:
        """Run one utility. Events a utility that changes producers caused are gathered before
        it returns (rule 5), so they leave before (or with) its answer."""
        try:
            return self.utility_handlers[type(utility)](utility)  # type: ignore[no-any-return]
        finally:
            if utility.CHANGES_PRODUCERS:
                self.notifications.collect(Moment.UTILITY)

    @staticmethod
    def read_utility(request: UtilityRequest) -> Utility[Any]:
        """A utility as it arrived on the wire (a name and positional arguments): an unknown
        name, or arguments that do not fit, are the caller's error, not a crash."""
        cls = UTILITIES.get(request.method)
        if cls is None:
            known = ", ".join(sorted(UTILITIES))
            raise UnknownMethodError(f"unknown utility {request.method!r} (known: {known})")
        try:
            utility: Utility[Any] = msgspec.convert(request.args, cls)
            return utility
        except msgspec.ValidationError as exc:
            raise ClientError(f"utility {request.method!r}: {exc}") from None

    def _collective_rpc(self, call: CollectiveRPC) -> list[Any]:
        """Call a worker-extension method on every rank; replies in rank order, as the method
        declares them.

        Only the extension's methods are reachable this way: the engine's own worker methods
        (stepping, cache set-up) would corrupt its state if a client called them.
        """
        if call.method not in self.extension_methods:
            known = ", ".join(sorted(self.extension_methods)) or "none: no --worker-extension-cls"
            raise UnknownMethodError(
                f"{call.method!r} is not a worker extension method (available: {known})"
            )
        try:
            args = tuple(call.args or ())
            return self.executor.collective_rpc(call.method, args, timeout=call.timeout)
        except ExecutorError as exc:
            raise ExtensionCallError(str(exc)) from exc

    def gather_worker_notifications(self) -> int:
        """Collect every rank's notifications now (they leave with the next output)."""
        return self.notifications.gather()

    def snapshot(self) -> EngineStateSnapshot:
        """Rule 8 (catch-up): the state as of the last flushed event, which is the engine
        view's: every event that left was applied to it, so the stream that follows continues
        after it, and every API server's view started from it equals its siblings'."""
        return self.view.state()

    def stats(self) -> SchedulerStats:
        """The scheduler's load figures plus what the notification channel has cost so far."""
        stats = self.scheduler.stats()
        stats.kv_cache_committed_bytes = self.kv_cache_committed_bytes
        stats.kv_cache_dtype = self.kv_cache_dtype
        stats.notification_gathers = self.notifications.gathers
        stats.notification_gather_seconds = self.notifications.gather_seconds
        if self.loras is not None:
            # Parked requests (their adapter's turn is over) count as running: started, and
            # holding their KV blocks.
            running = collections.Counter(
                r.lora_name for r in (*self.scheduler.running, *self.scheduler.parked)
            )
            waiting = collections.Counter(r.lora_name for r in self.scheduler.waiting)
            running.pop(None, None)
            waiting.pop(None, None)
            stats.running_lora_requests = dict(sorted(running.items()))  # type: ignore[arg-type]
            stats.waiting_lora_requests = dict(sorted(waiting.items()))  # type: ignore[arg-type]
            stats.running_lora_adapters = list(stats.running_lora_requests)
            stats.waiting_lora_adapters = list(stats.waiting_lora_requests)
            sets = (tuple(stats.running_lora_adapters), tuple(stats.waiting_lora_adapters))
            if sets != self._lora_request_sets:
                self._lora_request_sets, self._lora_requests_changed_at = sets, time.time()
            stats.lora_requests_changed_at = self._lora_requests_changed_at
        return stats

    def _take_kv_events(self) -> None:
        """The block manager's cache changes since the last call: published as the engine's own
        events (the view applies them as they leave), and handed to the KV-event sinks as one
        batch. Called at start, after each step and at a reset, so an
        incarnation's first `KVCacheCleared` and a reset's leave at once, idle or not."""
        events = self.scheduler.blocks.take_kv_events()
        if not events:
            return
        if self.config.cache.kv_events:  # --kv-events: the channel carries them too
            for event in events:
                self.notifications.publish_engine_event(event)
        for sink in self.kv_event_sinks:
            sink(events)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (refused while requests hold blocks)."""
        reset = self.scheduler.blocks.reset_prefix_cache()
        self._take_kv_events()
        return reset

    def on_rank_failure(self, callback: Callable[[str], None]) -> None:
        """Have `callback(why)` called, from the executor's monitor thread, when a rank dies:
        the process driving this core wakes its busy loop with it, even while idle."""
        self.executor.failure_callback = callback

    def shutdown(self) -> None:
        self.executor.shutdown()
