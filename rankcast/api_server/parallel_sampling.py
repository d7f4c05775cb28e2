"""`n > 1` and `best_of`: one prompt sampled several times, as one response with several choices.

Each sample is a child request of its own (`{request_id}-{i}`), all to the engine core the
router chose for the prompt. The first child goes alone; the others are submitted once its first
output has come, when the prompt's full blocks are computed and in the prefix cache, so each of
them computes only the prompt's last partial block: the samples share the prompt's KV blocks, as
vLLM's parallel sampling does. A seeded request gives child i the seed `seed + i` (vLLM's rule),
so every choice is reproducible and no two are the same draw.

`best_of` (completions) samples that many and answers the `n` whose tokens are most likely
(the sum of their log-probabilities), as OpenAI's legacy API does; it cannot stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import msgspec

from rankcast.api_server.schema import INT_MIN, UINT_MAX
from rankcast.outputs import CompletionOutput, RequestOutput
from rankcast.sampling_params import SamplingParams


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The sampling parameters of sample `index`: its own seed when the request has one; the
    prompt is scored (`prompt_logprobs`) by the first sample alone, since scoring it takes no
    prefix-cache hits and every sample's prompt is the same."""
    if index == 0:
        return params
    seed = params.seed
    if seed is not None:
        seed += index
        if seed > UINT_MAX:  # wraps within the range torch's generators take
            seed += INT_MIN - UINT_MAX - 1
    return msgspec.structs.replace(params, seed=seed, prompt_logprobs=None)


async def samples(
    start: Callable[[int], AsyncIterator[RequestOutput]], count: int
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Every sample's outputs as they come, with the sample's index. Leaving early (a client
    gone, an error) closes every sample's stream, which aborts its engine request."""
    first = start(0)
    try:
        head = await anext(first)
    except StopAsyncIteration:
        return
    except BaseException:
        await _close(first)
        raise
    yield 0, head
    if count == 1:
        async for output in first:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                await queue.put((index, output))
        except Exception as exc:  # the engine's refusal or death, raised where it is read
            await queue.put((index, exc))
        await queue.put((index, None))

    streams = [first, *(start(i) for i in range(1, count))]
    pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    running = count
    try:
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in pumps:
            task.cancel()
        for task in pumps:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for stream in streams:
            await _close(stream)


async def _close(stream: AsyncIterator[RequestOutput]) -> None:
    """End a sample's stream now (an async generator's `aclose`): its engine request is
    aborted if it had not finished."""
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


async def finals(
    start: Callable[[int], AsyncIterator[RequestOutput]], count: int
) -> list[RequestOutput]:
    """Each sample's last output, in index order."""
    last: dict[int, RequestOutput] = {}
    async for index, output in samples(start, count):
        last[index] = output
    return [last[i] for i in range(count)]


def likelihood(completion: CompletionOutput) -> float:
    """The sum of the sampled tokens' log-probabilities (`best_of`'s ranking)."""
    entries = completion.logprobs or []
    return sum(
        entry[token].logprob
        for token, entry in zip(completion.token_ids, entries, strict=False)
        if token in entry
    )
