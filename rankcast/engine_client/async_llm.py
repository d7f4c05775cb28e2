"""The API server's engine handle: asyncio generation over engine cores in other processes.

There is one client per data-parallel engine core; each new request goes to the engine the
router chooses (`engine_router.py`: by load, cached prefix and adapter residency, from what the
channel delivered). One output task per engine core reads everything it sends to this API
server, turns token ids into text (stop strings included) and hands each request's outputs to
the coroutine awaiting them. Engine-wide stats and per-request timings go to an observer (the
server's metrics). Each engine's catch-up snapshot and notifications, decoded one by one, are
applied to its engine view (`engine_views.py`), which the router, serving and the metrics read;
then the sinks that follow changes (metrics, `/v1/events`) are told.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from rankcast.channel.decoder import NotificationDecoder
from rankcast.channel.events import Notification
from rankcast.channel.snapshot import EngineStateSnapshot
from rankcast.engine_client.engine_router import Choice, EngineRouter
from rankcast.engine_client.engine_views import EngineViews
from rankcast.engine_client.mp_client import AsyncMPClient, EngineDeadError
from rankcast.engine_client.output_processor import OutputProcessor
from rankcast.outputs import RequestOutput, RequestRejectedError
from rankcast.protocol import EngineCoreRequest, R, SchedulerStats, Utility
from rankcast.sampling_params import SamplingParams
from rankcast.tokenizer import ModelTokenizer

logger = logging.getLogger(__name__)


class EngineObserver(Protocol):
    """What the serving layer records; implemented by the Prometheus metrics."""

    def record_scheduler_stats(self, engine_index: int, stats: SchedulerStats) -> None: ...

    def record_engine_up(self, engine_index: int, up: bool) -> None:
        """Connected (True), or gone (False: nothing it reported is true any more)."""

    def record_first_token(self, seconds: float) -> None: ...

    def record_inter_token(self, seconds: float, tokens: int) -> None:
        """May be held until `record_step_end` (it is recorded for every streamed token)."""

    def record_step_end(self) -> None:
        """One engine step's outputs are recorded: write what was held. Called before the
        output loop next awaits, so no scrape sees part of a step."""

    def record_finished(
        self,
        engine_index: int,
        e2e_seconds: float,
        prompt_tokens: int,
        generation_tokens: int,
        finish_reason: str,
    ) -> None: ...


class NotificationSink(Protocol):
    """What follows the engine views' changes in an API server (metrics, `/v1/events`); told
    after the views have applied the snapshot or the batch, so it reads them up to date."""

    def apply_snapshot(self, snapshot: EngineStateSnapshot) -> None: ...

    def consume(
        self, engine: int, notifications: list[Notification], unknown: list[str], now: float
    ) -> None:
        """One batch from `engine`; `unknown` holds the type names this server could not
        decode."""


@dataclass
class _Stream:
    queue: asyncio.Queue[RequestOutput | Exception]
    arrival: float
    engine: int = 0
    last_token_at: float | None = None
    prompt_tokens: int = 0


class AsyncLLM:
    def __init__(
        self,
        clients: list[AsyncMPClient],
        tokenizer: ModelTokenizer,
        observer: EngineObserver,
        sinks: list[NotificationSink] | None = None,
        router: EngineRouter | None = None,
        views: EngineViews | None = None,
    ) -> None:
        self.clients = clients
        self.tokenizer = tokenizer
        self.observer = observer
        # Every engine's state as its snapshot and events describe it: written here only.
        self.views = views if views is not None else EngineViews(len(clients))
        self.router = router or EngineRouter(self.views)
        self.sinks = list(sinks or [])
        self.notification_decoder = NotificationDecoder()
        self.output_processor = OutputProcessor(tokenizer)
        self.streams: dict[str, _Stream] = {}
        self.output_tasks: list[asyncio.Task[None]] = []
        self.background: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await asyncio.gather(*(client.start() for client in self.clients))
        for engine in range(len(self.clients)):
            self.observer.record_engine_up(engine, True)
        for client in self.clients:
            snapshot = client.ready.snapshot if client.ready is not None else None
            if snapshot is not None:
                self._apply_snapshot(snapshot)
        self.output_tasks = [
            asyncio.create_task(self._output_loop(engine)) for engine in range(len(self.clients))
        ]

    @property
    def max_model_len(self) -> int:
        return min(client.max_model_len for client in self.clients)

    @property
    def dead(self) -> EngineDeadError | None:
        """Why this server cannot serve: every engine core is gone. While one of several
        data-parallel engines lives, new requests go to it (the balancer skips the dead)."""
        if all(c.dead is not None for c in self.clients):
            return self.clients[0].dead
        return None

    def engine_health(self) -> list[tuple[int, str | None]]:
        """(engine index, why it is gone or None while it serves), for every engine core."""
        return [(i, None if c.dead is None else str(c.dead)) for i, c in enumerate(self.clients)]

    def route(self, prompt_token_ids: list[int], lora_name: str | None = None) -> Choice:
        """The engine a request goes to (skipping dead ones), and why."""
        alive = [c.dead is None for c in self.clients]
        return self.router.choose(alive, prompt_token_ids, lora_name)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        lora_name: str | None = None,
        choice: Choice | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; leaving early aborts it in the engine.
        `choice`: the engine `route` chose (routed here when not given)."""
        if choice is None:
            choice = self.route(prompt_token_ids, lora_name)
        engine = choice.engine
        client = self.clients[engine]
        reason = choice.reason  # "" with one engine: the engine counts only real choices
        stream = _Stream(
            asyncio.Queue(), time.time(), engine=engine, prompt_tokens=len(prompt_token_ids)
        )
        self.streams[request_id] = stream
        self.output_processor.add_request(request_id, prompt, prompt_token_ids, params)
        finished = False
        try:
            await client.add_request(
                EngineCoreRequest(
                    request_id,
                    prompt_token_ids,
                    params,
                    arrival_time=stream.arrival,
                    client_index=client.client_index,
                    lora_name=lora_name,
                    routing_reason=reason,
                    routing_expected_prefix_tokens=choice.expected_prefix_tokens if reason else 0,
                )
            )
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                if item.error is not None:
                    raise RequestRejectedError(item.error)
                yield item
                if finished:
                    return
        finally:
            self.streams.pop(request_id, None)
            if not finished:
                self.output_processor.abort_requests([request_id])
                await client.abort_requests([request_id])

    async def call(self, utility: Utility[R]) -> list[R]:
        """Run a utility on every engine core (adapters and extensions are per engine);
        answers in engine order."""
        return list(await asyncio.gather(*(c.call(utility) for c in self.clients)))

    def _record_timing(self, stream: _Stream, output: RequestOutput, now: float) -> None:
        completion = output.outputs[0]
        new_tokens = len(completion.delta_token_ids)
        if new_tokens:
            if stream.last_token_at is None:
                self.observer.record_first_token(now - stream.arrival)
                if new_tokens > 1:
                    self.observer.record_inter_token(0.0, new_tokens - 1)
            else:
                self.observer.record_inter_token(
                    (now - stream.last_token_at) / new_tokens, new_tokens
                )
            stream.last_token_at = now
        if output.finished:
            self.observer.record_finished(
                stream.engine,
                now - stream.arrival,
                stream.prompt_tokens,
                len(completion.token_ids),
                completion.finish_reason or "abort",
            )

    async def _output_loop(self, engine: int) -> None:
        client = self.clients[engine]
        while True:
            try:
                outputs = await client.get_output()
            except EngineDeadError as exc:
                self.observer.record_engine_up(engine, False)
                for stream in self.streams.values():
                    if stream.engine == engine:
                        stream.queue.put_nowait(exc)
                await self._reconnect(engine)
                continue
            if outputs.engine_notifications:
                self._deliver_notifications(engine, outputs.engine_notifications)
            if outputs.scheduler_stats is not None:
                self.views.record_stats(engine, outputs.scheduler_stats)
                self.router.record_stats(engine, outputs.scheduler_stats)
                self.observer.record_scheduler_stats(outputs.engine_index, outputs.scheduler_stats)
            if not outputs.outputs:
                continue
            processed = self.output_processor.process_outputs(outputs.outputs)
            now = time.time()
            for output in processed.request_outputs:
                owner = self.streams.get(output.request_id)
                if owner is None:
                    continue
                self._record_timing(owner, output, now)
                owner.queue.put_nowait(output)
            self.observer.record_step_end()
            if processed.requests_to_abort:
                await client.abort_requests(processed.requests_to_abort)

    async def _reconnect(self, engine: int) -> None:
        """Wait for the dead engine core's next incarnation (the launcher restarts it), then
        serve from it: its snapshot restarts every sink's view of that engine (the router's
        index of it included), and the router sends it new requests again. Until then this
        server answers 503 for it."""
        client = self.clients[engine]
        await client.reconnect()
        self.observer.record_engine_up(engine, True)
        snapshot = client.ready.snapshot if client.ready is not None else None
        if snapshot is not None:
            self._apply_snapshot(snapshot)
        logger.info(
            "engine core %d is back (incarnation %d)",
            engine,
            snapshot.incarnation if snapshot is not None else 0,
        )

    def _apply_snapshot(self, snapshot: EngineStateSnapshot) -> None:
        """An engine (re)connected: its view starts over from its snapshot, then the router
        forgets what it guessed about it and the sinks show the new state."""
        self.views.apply_snapshot(snapshot)
        self.router.engine_restarted(snapshot.engine_index)
        for sink in self.sinks:
            sink.apply_snapshot(snapshot)

    def _deliver_notifications(self, engine: int, raws: list[Any]) -> None:
        known, unknown = self.notification_decoder.decode(raws)
        if unknown:
            logger.warning(
                "skipping %d notification(s) of unknown type(s) %s",
                len(unknown),
                sorted(set(unknown)),
            )
        now = time.time()
        self.views.consume(engine, known, unknown)
        for sink in self.sinks:
            sink.consume(engine, known, unknown, now)

    def fail_all(self, error: Exception) -> None:
        """End every request in flight with `error` (its stream raises it) and abort them in
        the engines: what a stopping server does with what did not finish in time."""
        by_engine: dict[int, list[str]] = {}
        for request_id, stream in self.streams.items():
            stream.queue.put_nowait(error)
            by_engine.setdefault(stream.engine, []).append(request_id)
        for engine, request_ids in by_engine.items():
            client = self.clients[engine]
            if client.dead is None:
                # The loop keeps only a weak reference to a task: hold it until it is done.
                task = asyncio.get_running_loop().create_task(client.abort_requests(request_ids))
                self.background.add(task)
                task.add_done_callback(self.background.discard)

    def shutdown(self) -> None:
        for task in self.output_tasks:
            task.cancel()
        for client in self.clients:
            client.shutdown()
