"""Chat and text completions: requests to engine calls, outputs to OpenAI response bodies."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rankcast.api_server.drain import ServerShuttingDownError
from rankcast.api_server.errors import APIError, error_body
from rankcast.api_server.output_parsers import (
    HermesToolParser,
    OutputParser,
    ThinkParser,
    prompt_opens_think,
)
from rankcast.api_server.parallel_sampling import child_params, finals, likelihood, samples
from rankcast.api_server.schema import ChatCompletionRequest, CompletionRequest
from rankcast.api_server.structured import ToolCallShape, auto_tools, requested_shape
from rankcast.engine_client.async_llm import AsyncLLM
from rankcast.engine_client.engine_router import Choice
from rankcast.engine_client.mp_client import EngineDeadError
from rankcast.outputs import Logprob, RequestOutput, RequestRejectedError
from rankcast.sampling_params import SamplingParams
from rankcast.structured_outputs import StructuredOutputs
from rankcast.tokenizer import ModelTokenizer

T = TypeVar("T")


@dataclass
class ServingContext:
    engine: AsyncLLM
    tokenizer: ModelTokenizer
    model_name: str
    # How chat outputs are read (--reasoning-parser; --tool-call-parser with
    # --enable-auto-tool-choice): output_parsers.py.
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None

    def shape(
        self, body: ChatCompletionRequest | CompletionRequest
    ) -> tuple[StructuredOutputs | None, ToolCallShape | None]:
        """The request's output shape, as this server reads tool calls (structured.py)."""
        return requested_shape(body, auto_tool_choice=self.tool_call_parser is not None)


def check_model(ctx: ServingContext, requested: str | None) -> str | None:
    """The LoRA adapter the request names in `model`, or None for the base model. Responses
    name the model as the request did (`requested or ctx.model_name`), as OpenAI's do."""
    if requested is None or requested == ctx.model_name:
        return None
    views = ctx.engine.views
    if requested in views.adapter_names():
        refusal = views.refusal(requested)
        if refusal is not None:
            raise APIError(400, refusal, "model")
        return requested
    raise APIError(404, f"The model `{requested}` does not exist.", "model")


# Names the data-parallel engine core that served the request (the router's choice).
ENGINE_HEADER = "x-rankcast-engine"


def live(serving: ServingContext) -> ServingContext:
    """`serving`, or a 503 when the engine core has died: every engine-backed route starts
    here, so a dead engine is reported instead of a request hanging on it."""
    if serving.engine.dead is not None:
        raise APIError(503, f"The engine core is not running: {serving.engine.dead}")
    return serving


def sampling_params(
    ctx: ServingContext,
    body: ChatCompletionRequest | CompletionRequest,
    prompt_len: int,
    max_tokens: int | None,
    logprobs: int | None,
    structured: StructuredOutputs | None = None,
) -> SamplingParams:
    limit = ctx.engine.max_model_len
    if prompt_len >= limit:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, your request has "
            f"{prompt_len} prompt tokens, leaving no room to generate. Please shorten the prompt.",
            "messages" if isinstance(body, ChatCompletionRequest) else "prompt",
        )
    if max_tokens is not None and prompt_len + max_tokens > limit:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
            "completion). Please reduce the prompt or max_tokens.",
            "max_tokens",
        )
    try:
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            min_p=body.min_p or 0.0,
            seed=body.seed,
            max_tokens=max_tokens,
            stop=list(body.stop or []),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            structured=structured,
        )
    except ValueError as exc:
        raise APIError(400, str(exc)) from None


async def run_unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, cancelling it (and so aborting its engine request) if the client leaves."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    with suppress(asyncio.CancelledError):
        await task
    return None


async def final_output(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    """A request's last output (the finished one)."""
    last = None
    async for output in stream:
        last = output
    assert last is not None
    return last


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


_json = msgspec.json.Encoder()


def _sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event; msgspec encodes JSON several times faster than the stdlib."""
    data = payload.encode() if isinstance(payload, str) else _json.encode(payload)
    return b"data: " + data + b"\n\n"


def _chat_logprobs(
    entries: list[dict[int, Logprob]], token_ids: list[int], top: int
) -> dict[str, Any]:
    content = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        chosen = entry[token_id]
        ranked = sorted(entry.values(), key=lambda lp: lp.rank)[:top]
        content.append(
            {
                "token": chosen.decoded_token,
                "logprob": chosen.logprob,
                "bytes": list(chosen.decoded_token.encode()),
                "top_logprobs": [
                    {
                        "token": lp.decoded_token,
                        "logprob": lp.logprob,
                        "bytes": list(lp.decoded_token.encode()),
                    }
                    for lp in ranked
                ],
            }
        )
    return {"content": content}


def _completion_logprobs(
    entries: list[dict[int, Logprob]] | list[dict[int, Logprob] | None],
    token_ids: list[int],
    top: int,
    offset: int = 0,
    decode: Callable[[int], str] | None = None,
) -> dict[str, Any]:
    """The legacy completion shape; `text_offset` is where each token's text starts in the
    choice's text (a stream's chunk starts at the length of the text streamed before it). An
    echoed prompt's first token has no logprob (None): its text is `decode`'s."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        offsets.append(offset)
        if entry is None:
            text = decode(token_id) if decode is not None else ""
            tokens.append(text)
            token_logprobs.append(None)
            tops.append(None)
            offset += len(text)
            continue
        chosen = entry[token_id]
        offset += len(chosen.decoded_token)
        tokens.append(chosen.decoded_token)
        token_logprobs.append(chosen.logprob)
        ranked = sorted(entry.values(), key=lambda lp: lp.rank)[:top]
        tops.append({lp.decoded_token: lp.logprob for lp in ranked})
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _joined_logprobs(first: dict[str, Any], then: dict[str, Any] | None) -> dict[str, Any]:
    """Two runs of legacy logprobs as one (an echoed prompt's, then the completion's)."""
    if then is None:
        return first
    return {key: first[key] + then[key] for key in first}


def _dead_error() -> dict[str, dict[str, str | int | None]]:
    return error_body(503, "The engine core is not running; the request cannot complete.")


def chat_prompt(ctx: ServingContext, body: ChatCompletionRequest) -> tuple[str, list[int]]:
    """The prompt text of a chat request and the token ids the engine computes for it: its
    messages (and tools, and `chat_template_kwargs`) through the model's chat template.
    `/v1/chat/completions/render` answers exactly these ids."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    try:
        # Fields beyond role and content (an assistant's tool_calls, a tool's tool_call_id)
        # are the template's to use.
        messages = [
            {**(m.model_extra or {}), "role": m.role, "content": m.text()} for m in body.messages
        ]
        text = ctx.tokenizer.render_chat(messages, True, tools, body.chat_template_kwargs)
    except ValueError as exc:
        raise APIError(400, str(exc), "messages") from None
    # The template already wrote any BOS it wants; encoding must not add a second one.
    return text, ctx.tokenizer.encode(text, add_special_tokens=False)


def chat_prompt_ids(ctx: ServingContext, body: ChatCompletionRequest) -> list[int]:
    return chat_prompt(ctx, body)[1]


def output_parser(
    ctx: ServingContext,
    body: ChatCompletionRequest,
    prompt: str,
    structured: StructuredOutputs | None,
    forced: ToolCallShape | None,
) -> OutputParser | None:
    """What reads this chat's output (None: it is all content): the reasoning parser unless
    the request forces tool calls (the output is then their JSON), the tool-call parser when
    the request leaves calling its tools to the model."""
    tools = None
    if ctx.tool_call_parser == "hermes" and auto_tools(body):
        tools = HermesToolParser()
    think = None
    if ctx.reasoning_parser == "qwen3" and forced is None:
        think = ThinkParser(
            opened=prompt_opens_think(prompt),
            constrained=structured is not None,
            call_ends=tools is not None,
        )
    if think is None and tools is None:
        return None
    return OutputParser(think, tools)


def completion_prompt(ctx: ServingContext, body: CompletionRequest) -> tuple[str | None, list[int]]:
    """A completion request's prompt text (None when given as token ids) and the token ids the
    engine computes for it. `/v1/completions/render` answers these."""
    if isinstance(body.prompt, str):
        prompt_text: str | None = body.prompt
        prompt_ids = ctx.tokenizer.encode(body.prompt)
    else:
        # A list of strings became its one string in validation: these are token ids.
        prompt_text, prompt_ids = None, [int(t) for t in body.prompt]
        vocab = len(ctx.tokenizer)
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
    if not prompt_ids:
        raise APIError(400, "the prompt is empty", "prompt")
    return prompt_text, prompt_ids


async def create_chat_completion(
    ctx: ServingContext, body: ChatCompletionRequest, request: Request
) -> Response:
    lora_name = check_model(ctx, body.model)
    structured, tool_calls = ctx.shape(body)
    prompt_text, prompt_ids = chat_prompt(ctx, body)

    def parser() -> OutputParser | None:
        """A parser per choice: each reads its own sample's text."""
        return output_parser(ctx, body, prompt_text, structured, tool_calls)

    # The reasoning fields are there whenever the server reads reasoning, as vLLM's are.
    reasoning_fields = ctx.reasoning_parser is not None
    top = body.top_logprobs or 0
    params = sampling_params(
        ctx, body, len(prompt_ids), body.output_limit(), top if body.logprobs else None, structured
    )
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    model = body.model or ctx.model_name
    routed = ctx.engine.route(prompt_ids, lora_name)
    start = _sampler(ctx, request_id, prompt_ids, params, body.n, lora_name, routed)
    headers = {ENGINE_HEADER: str(routed.engine)}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _chat_stream(
                _StreamState(
                    _header(model, request_id, created, "chat.completion.chunk"),
                    len(prompt_ids),
                    cut_choices=[
                        {"index": i, "delta": {}, "logprobs": None, "finish_reason": "abort"}
                        for i in range(body.n)
                    ],
                ),
                samples(start, body.n),
                include_usage,
                top if body.logprobs else None,
                tool_calls,
                [parser() for _ in range(body.n)],
            ),
            media_type="text/event-stream",
            headers=headers,
        )
    outputs = await run_unless_disconnected(request, finals(start, body.n))
    if outputs is None:
        return Response(status_code=499)
    choices = []
    for index, final in enumerate(outputs):
        completion = final.outputs[0]
        message, finish_reason = _chat_message(
            completion.text, completion.finish_reason, tool_calls, parser(), reasoning_fields
        )
        choice: dict[str, Any] = {
            "index": index,
            "message": message,
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        if body.logprobs and completion.logprobs is not None:
            choice["logprobs"] = _chat_logprobs(completion.logprobs, completion.token_ids, top)
        choices.append(choice)
    generated = sum(len(final.outputs[0].token_ids) for final in outputs)
    return JSONResponse(
        {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": _usage(len(prompt_ids), generated),
        },
        headers=headers,
    )


def _sampler(
    ctx: ServingContext,
    request_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    count: int,
    lora_name: str | None,
    routed: Choice,
    prompt_text: str | None = None,
) -> Callable[[int], AsyncIterator[RequestOutput]]:
    """How to start sample `i` of a request (parallel_sampling.py): one engine request, with
    the request's own id when it is the only one."""

    def start(index: int) -> AsyncIterator[RequestOutput]:
        child_id = request_id if count == 1 else f"{request_id}-{index}"
        return ctx.engine.generate(
            child_id,
            prompt_ids,
            child_params(params, index),
            prompt_text,
            lora_name=lora_name,
            choice=routed,
        )

    return start


def _chat_message(
    text: str,
    finish_reason: str | None,
    tool_calls: ToolCallShape | None,
    parser: OutputParser | None = None,
    reasoning_fields: bool = False,
) -> tuple[dict[str, Any], str | None]:
    """The assistant message and finish reason: tool calls where the request forced them and
    the output holds them, the text as content otherwise (as when max_tokens cut the JSON);
    with a parser, the reasoning and the calls the model wrote itself taken out of the text."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning_fields:
        message.update(reasoning=None, reasoning_content=None)
    calls = tool_calls.calls(text) if tool_calls is not None and finish_reason == "stop" else None
    if calls is not None:
        assert tool_calls is not None
        return {**message, "content": None, "tool_calls": calls}, tool_calls.finish_reason
    if parser is None:
        return message, finish_reason
    parsed = parser.whole(text)
    # No text beside reasoning or calls is no content, as OpenAI's and vLLM's answers say it.
    message["content"] = parsed.content or (None if parsed.reasoning or parsed.calls else "")
    if reasoning_fields:
        message.update(reasoning=parsed.reasoning, reasoning_content=parsed.reasoning)
    if parsed.calls:
        message["tool_calls"] = [call.as_message() for call in parsed.calls]
        return message, "tool_calls"
    return message, finish_reason


def _header(model: str, request_id: str, created: int, kind: str) -> dict[str, Any]:
    """The fields every chunk of one streamed response repeats."""
    return {"id": request_id, "object": kind, "created": created, "model": model}


@dataclass
class _StreamState:
    """What the shared stream tail needs from a stream's body."""

    header: dict[str, Any]
    prompt_tokens: int
    # Tokens generated so far, by choice.
    completion_tokens: dict[int, int] = field(default_factory=dict)
    # The last choices of a stream a stopping server cuts off (their shape differs by endpoint).
    cut_choices: list[dict[str, Any]] = field(default_factory=list)


async def _event_stream(
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    state: _StreamState,
    include_usage: bool,
    render: Callable[[int, RequestOutput], bytes],
    count: int,
    opening: bytes = b"",
) -> AsyncIterator[bytes]:
    """Every stream's shape: the opening events, one write per output with that output's
    events (`render`, given the output's choice; b"" for none), and the same ending: engine
    death as an error event, the usage chunk, then [DONE]. The last output's events leave in
    one write with the ending, so a stream's last token costs one write, not four. One
    generator per stream, with the endpoint's shape a plain function, because every layer of
    async generators is resumed once per streamed token."""
    if opening:
        yield opening
    pending, finished = b"", 0
    try:
        async for index, output in outputs:
            events = render(index, output)
            finished += output.finished
            if finished == count:
                pending = events
            elif events:
                yield events
    except EngineDeadError:
        yield pending + _sse(_dead_error()) + _sse("[DONE]")
        return
    except RequestRejectedError as exc:
        yield pending + _sse(error_body(400, str(exc))) + _sse("[DONE]")
        return
    except ServerShuttingDownError as exc:
        # A finish reason for clients that read only chunks, the error for those that read it.
        cut = b""
        if state.cut_choices:
            cut = _sse({**state.header, "choices": state.cut_choices})
        yield pending + cut + _sse(error_body(503, str(exc))) + _sse("[DONE]")
        return
    if include_usage:
        usage = _usage(state.prompt_tokens, sum(state.completion_tokens.values()))
        pending += _sse({**state.header, "choices": [], "usage": usage})
    yield pending + _sse("[DONE]")


def _delta_logprobs(
    output: RequestOutput,
    top: int | None,
    render: Callable[[list[dict[int, Logprob]], list[int], int], dict[str, Any]],
) -> dict[str, Any] | None:
    completion = output.outputs[0]
    if top is None or not completion.delta_logprobs or not completion.delta_token_ids:
        return None
    return render(completion.delta_logprobs, completion.delta_token_ids, top)


def _chat_stream(
    state: _StreamState,
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    include_usage: bool,
    top: int | None,
    tool_calls: ToolCallShape | None,
    parsers: list[OutputParser | None],
) -> AsyncIterator[bytes]:
    """Chat chunks, each choice's from its own sample; a tool-forcing request's output is held
    back and sent, once complete, as one `tool_calls` delta (its JSON means nothing to a client
    until it is whole). With a parser, each output's text becomes reasoning, content and
    tool-call deltas, in chunks of their own (clients read one kind per delta); a call the
    model wrote is sent once complete, as OpenAI streams one: its id and name, then its
    arguments."""
    header = state.header
    calls_sent = [0] * len(parsers)

    def chunk(
        index: int,
        delta: dict[str, Any],
        finish: str | None,
        logprobs: dict[str, Any] | None = None,
    ) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return _sse({**header, "choices": [choice]})

    def render(index: int, output: RequestOutput) -> bytes:
        completion = output.outputs[0]
        state.completion_tokens[index] = len(completion.token_ids)
        logprobs = _delta_logprobs(output, top, _chat_logprobs)
        if tool_calls is not None:
            if not output.finished:
                return b""
            message, finish = _chat_message(completion.text, completion.finish_reason, tool_calls)
            delta = {k: v for k, v in message.items() if k != "role"}
            if "tool_calls" in delta:
                delta["tool_calls"] = [
                    {"index": i, **call} for i, call in enumerate(delta["tool_calls"])
                ]
            return chunk(index, delta, None) + chunk(index, {}, finish)
        if parsers[index] is not None:
            return parsed_events(index, output, logprobs)
        events = b""
        if completion.delta_text or logprobs:
            events = chunk(index, {"content": completion.delta_text}, None, logprobs)
        if output.finished:
            events += chunk(index, {}, completion.finish_reason)
        return events

    def parsed_events(index: int, output: RequestOutput, logprobs: dict[str, Any] | None) -> bytes:
        parser = parsers[index]
        assert parser is not None
        completion = output.outputs[0]
        reasoning, parsed = parser.step(completion.delta_text, output.finished)
        deltas: list[dict[str, Any]] = []
        if reasoning:
            deltas.append({"reasoning": reasoning, "reasoning_content": reasoning})
        if parsed.content:
            deltas.append({"content": parsed.content})
        for call in parsed.calls:
            position = calls_sent[index]
            calls_sent[index] += 1
            named = {"name": call.name, "arguments": ""}
            head = {"index": position, "id": call.id, "type": "function", "function": named}
            deltas.append({"tool_calls": [head]})
            arguments = {"index": position, "function": {"arguments": call.arguments}}
            deltas.append({"tool_calls": [arguments]})
        if logprobs and not deltas:
            deltas.append({})  # the tokens' logprobs, their text held back for now
        events = b"".join(
            chunk(index, delta, None, logprobs if i == 0 else None)
            for i, delta in enumerate(deltas)
        )
        if output.finished:
            finish = "tool_calls" if calls_sent[index] else completion.finish_reason
            events += chunk(index, {}, finish)
        return events

    opening = b"".join(
        chunk(i, {"role": "assistant", "content": ""}, None) for i in range(len(parsers))
    )
    return _event_stream(outputs, state, include_usage, render, len(parsers), opening)


async def create_completion(
    ctx: ServingContext, body: CompletionRequest, request: Request
) -> Response:
    lora_name = check_model(ctx, body.model)
    prompt_text, prompt_ids = completion_prompt(ctx, body)
    structured, _ = ctx.shape(body)
    top = body.logprobs
    # best_of ranks its samples by their tokens' log-probabilities: it needs them whether or
    # not the client asked for them.
    ranked = body.best_of is not None and body.best_of > body.n
    wanted = (top or 0) if ranked else top
    params = sampling_params(ctx, body, len(prompt_ids), body.max_tokens, wanted, structured)
    echo = ""
    if body.echo:
        echo = prompt_text if prompt_text is not None else ctx.tokenizer.decode(prompt_ids)
        if top is not None:
            # The prompt's tokens are scored too, as the completion's are.
            params = msgspec.structs.replace(params, prompt_logprobs=top)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    model = body.model or ctx.model_name
    routed = ctx.engine.route(prompt_ids, lora_name)
    count = body.best_of if ranked and body.best_of is not None else body.n
    start = _sampler(ctx, request_id, prompt_ids, params, count, lora_name, routed, prompt_text)
    headers = {ENGINE_HEADER: str(routed.engine)}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _completion_stream(
                _StreamState(
                    _header(model, request_id, created, "text_completion"),
                    len(prompt_ids),
                    cut_choices=[
                        {"index": i, "text": "", "logprobs": None, "finish_reason": "abort"}
                        for i in range(count)
                    ],
                ),
                samples(start, count),
                include_usage,
                top,
                count,
                echo,
                _EchoedPrompt(ctx, prompt_ids, top) if echo and top is not None else None,
            ),
            media_type="text/event-stream",
            headers=headers,
        )
    outputs = await run_unless_disconnected(request, finals(start, count))
    if outputs is None:
        return Response(status_code=499)
    completions = [final.outputs[0] for final in outputs]
    generated = sum(len(c.token_ids) for c in completions)  # every sample is computed
    if ranked:
        completions = sorted(completions, key=likelihood, reverse=True)[: body.n]
    choices = []
    for index, completion in enumerate(completions):
        logprobs = None
        if top is not None and completion.logprobs is not None:
            logprobs = _completion_logprobs(completion.logprobs, completion.token_ids, top)
        if echo and top is not None:
            echoed = _echo_logprobs(ctx, outputs[0], prompt_ids, top)
            logprobs = _joined_logprobs(echoed, _shifted(logprobs, echoed))
        choices.append(
            {
                "index": index,
                "text": echo + completion.text,
                "logprobs": logprobs,
                "finish_reason": completion.finish_reason,
            }
        )
    return JSONResponse(
        {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": _usage(len(prompt_ids), generated),
        },
        headers=headers,
    )


def _echo_logprobs(
    ctx: ServingContext, output: RequestOutput, prompt_ids: list[int], top: int
) -> dict[str, Any]:
    """An echoed prompt's logprobs in the legacy shape (its first token has none)."""
    entries = output.prompt_logprobs or [None] * len(prompt_ids)
    return _completion_logprobs(
        entries, prompt_ids, top, decode=lambda token: ctx.tokenizer.decode([token])
    )


@dataclass
class _EchoedPrompt:
    """An echoed prompt's logprobs for each choice's first chunk of a stream: the first
    sample's scores (it alone scores the prompt, and its first output comes first)."""

    ctx: ServingContext
    prompt_ids: list[int]
    top: int
    scored: dict[str, Any] | None = None

    def __call__(self, output: RequestOutput) -> dict[str, Any]:
        if self.scored is None:
            self.scored = _echo_logprobs(self.ctx, output, self.prompt_ids, self.top)
        return self.scored


def _shifted(logprobs: dict[str, Any] | None, before: dict[str, Any]) -> dict[str, Any] | None:
    """Completion logprobs placed after an echoed prompt's: their offsets moved past its text."""
    if logprobs is None:
        return None
    end = before["text_offset"][-1] + len(before["tokens"][-1]) if before["tokens"] else 0
    return {**logprobs, "text_offset": [end + o for o in logprobs["text_offset"]]}


def _completion_stream(
    state: _StreamState,
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    include_usage: bool,
    top: int | None,
    count: int,
    echo: str = "",
    echo_logprobs: _EchoedPrompt | None = None,
) -> AsyncIterator[bytes]:
    """Completion chunks, each choice's from its own sample; with `echo`, the prompt's text
    (and, given `echo_logprobs`, its tokens' logprobs) leads each choice's first chunk."""
    header = state.header
    # Where each choice's next chunk's first token starts in its text.
    offsets = [0] * count
    echoes = [echo] * count

    def render(index: int, output: RequestOutput) -> bytes:
        completion = output.outputs[0]
        state.completion_tokens[index] = len(completion.token_ids)
        logprobs = None
        if top is not None:
            render_logprobs = functools.partial(_completion_logprobs, offset=offsets[index])
            logprobs = _delta_logprobs(output, top, render_logprobs)
        if echoes[index] and echo_logprobs is not None:
            echoed = echo_logprobs(output)
            logprobs = _joined_logprobs(echoed, _shifted(logprobs, echoed))
        if logprobs is not None and logprobs["tokens"]:
            offsets[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        if not (completion.delta_text or logprobs or output.finished):
            return b""
        text, echoes[index] = echoes[index] + completion.delta_text, ""
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": completion.finish_reason,
        }
        return _sse({**header, "choices": [choice]})

    return _event_stream(outputs, state, include_usage, render, count)
