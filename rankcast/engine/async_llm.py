"""The API server's engine handle: asyncio generation over an engine core in another process.

One output task reads everything the engine core sends to this API server, turns token ids into
text (stop strings included) and hands each request's outputs to the coroutine awaiting them.
Engine-wide stats and per-request timings go to an observer (the server's metrics).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from rankcast.engine.mp_client import AsyncMPClient, EngineDeadError
from rankcast.engine.output_processor import OutputProcessor
from rankcast.outputs import RequestOutput
from rankcast.protocol import EngineCoreRequest, SchedulerStats
from rankcast.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineObserver(Protocol):
    """What the serving layer records; implemented by the Prometheus metrics."""

    def record_scheduler_stats(self, engine_index: int, stats: SchedulerStats) -> None: ...

    def record_first_token(self, seconds: float) -> None: ...

    def record_inter_token(self, seconds: float, tokens: int) -> None: ...

    def record_finished(
        self, e2e_seconds: float, prompt_tokens: int, generation_tokens: int, finish_reason: str
    ) -> None: ...


@dataclass
class _Stream:
    queue: asyncio.Queue[RequestOutput | Exception]
    arrival: float
    last_token_at: float | None = None
    prompt_tokens: int = 0


class AsyncLLM:
    def __init__(self, client: AsyncMPClient, tokenizer: Any, observer: EngineObserver) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.observer = observer
        self.output_processor = OutputProcessor(tokenizer)
        self.streams: dict[str, _Stream] = {}
        self.output_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.client.start()
        self.output_task = asyncio.create_task(self._output_loop())

    @property
    def max_model_len(self) -> int:
        return self.client.max_model_len

    @property
    def dead(self) -> EngineDeadError | None:
        return self.client.dead

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; leaving early aborts it in the engine."""
        stream = _Stream(asyncio.Queue(), time.time(), prompt_tokens=len(prompt_token_ids))
        self.streams[request_id] = stream
        self.output_processor.add_request(request_id, prompt, prompt_token_ids, params)
        finished = False
        try:
            await self.client.add_request(
                EngineCoreRequest(
                    request_id,
                    prompt_token_ids,
                    params,
                    arrival_time=stream.arrival,
                    client_index=self.client.client_index,
                )
            )
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self.streams.pop(request_id, None)
            if not finished:
                self.output_processor.abort_requests([request_id])
                await self.client.abort_requests([request_id])

    async def call_utility(self, method: str, *args: Any) -> Any:
        return await self.client.call_utility(method, *args)

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
                now - stream.arrival,
                stream.prompt_tokens,
                len(completion.token_ids),
                completion.finish_reason or "abort",
            )

    async def _output_loop(self) -> None:
        while True:
            try:
                outputs = await self.client.get_output()
            except EngineDeadError as exc:
                for stream in self.streams.values():
                    stream.queue.put_nowait(exc)
                return
            if outputs.scheduler_stats is not None:
                self.observer.record_scheduler_stats(outputs.engine_index, outputs.scheduler_stats)
            if not outputs.outputs:
                continue
            processed = self.output_processor.process_outputs(outputs.outputs)
            now = time.time()
            for output in processed.request_outputs:
                stream = self.streams.get(output.request_id)
                if stream is None:
                    continue
                self._record_timing(stream, output, now)
                stream.queue.put_nowait(output)
            if processed.requests_to_abort:
                await self.client.abort_requests(processed.requests_to_abort)

    def shutdown(self) -> None:
        if self.output_task is not None:
            self.output_task.cancel()
        self.client.shutdown()
