"""One assistant turn as every chat-shaped API produces it: the engine request a chat body
starts, and its output read back as typed pieces (reasoning, content, tool calls).

`/v1/chat/completions`, `/v1/responses` and `/v1/messages` differ in how they are asked and how
they answer, not in what the model is given or how its output is read: the two newer APIs are
translated into a chat body (their own modules do that) and run through here, so the same
conversation gives the same prompt tokens and the same text on all three, and a fix to how
output is parsed reaches all three at once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from rankcast.api_server.errors import APIError
from rankcast.api_server.output_parsers import OutputParser
from rankcast.api_server.schema import ChatCompletionRequest
from rankcast.api_server.serving import (
    ServingContext,
    chat_prompt,
    check_model,
    final_output,
    output_parser,
    run_unless_disconnected,
    sampling_params,
)
from rankcast.api_server.structured import ToolCallShape
from rankcast.outputs import CompletionOutput, RequestOutput


@dataclass
class ChatTurn:
    """A chat request running on the engine: its outputs, and how to read them."""

    request_id: str
    model: str  # as the request named it (an adapter's name, or the base model's)
    prompt_ids: list[int]
    outputs: AsyncIterator[RequestOutput]
    engine: int  # the data-parallel engine core the router chose
    tool_calls: ToolCallShape | None  # set when the request forces tool calls
    parser: OutputParser | None  # set when the server reads reasoning or the model's calls


def as_chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """A chat body another API was translated into, validated as `/v1/chat/completions`
    validates its own; what it refuses is a 400 naming the chat field (the translating API
    checked its own fields first, so this is rare: a bad tool schema, a template variable)."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        message = str(first.get("msg")).removeprefix("Value error, ")
        raise APIError(400, f"{where}: {message}", where or None) from None


async def run_to_end(turn: ChatTurn, request: Request) -> CompletionOutput | None:
    """The turn's finished output; None when the client left first (its request aborted)."""
    output = await run_unless_disconnected(request, final_output(turn.outputs))
    return None if output is None else output.outputs[0]


def start_chat(ctx: ServingContext, body: ChatCompletionRequest, request_id: str) -> ChatTurn:
    """Validate `body` as `/v1/chat/completions` would and submit it (errors are APIError)."""
    lora_name = check_model(ctx, body.model)
    structured, tool_calls = ctx.shape(body)
    prompt_text, prompt_ids = chat_prompt(ctx, body)
    parser = output_parser(ctx, body, prompt_text, structured, tool_calls)
    params = sampling_params(ctx, body, len(prompt_ids), body.output_limit(), None, structured)
    routed = ctx.engine.route(prompt_ids, lora_name)
    outputs = ctx.engine.generate(
        request_id, prompt_ids, params, lora_name=lora_name, choice=routed
    )
    model = body.model or ctx.model_name
    return ChatTurn(request_id, model, prompt_ids, outputs, routed.engine, tool_calls, parser)


@dataclass(frozen=True)
class TextPiece:
    """Text of one kind: `reasoning` (what the model thought) or `content` (its answer)."""

    kind: str
    text: str


@dataclass(frozen=True)
class CallPiece:
    """A complete tool call; `arguments` is its JSON text."""

    id: str
    name: str
    arguments: str


Piece = TextPiece | CallPiece


@dataclass
class TurnReader:
    """Reads a turn's outputs into pieces, as they arrive (`feed`) or all at once (`whole`).

    A forced tool call's JSON means nothing until it is whole: it is held back and read when
    the output finishes (as content if it is not valid JSON, as when max_tokens cut it). With a
    parser, text is split into reasoning, content and the calls the model wrote itself."""

    turn: ChatTurn
    calls: int = 0
    _held: list[str] = field(default_factory=list)

    def feed(self, output: RequestOutput) -> list[Piece]:
        completion = output.outputs[0]
        if self.turn.tool_calls is not None:
            return self._forced(completion) if output.finished else []
        parser = self.turn.parser
        if parser is None:
            return [TextPiece("content", completion.delta_text)] if completion.delta_text else []
        reasoning, parsed = parser.step(completion.delta_text, output.finished)
        pieces: list[Piece] = []
        if reasoning:
            pieces.append(TextPiece("reasoning", reasoning))
        if parsed.content:
            pieces.append(TextPiece("content", parsed.content))
        for call in parsed.calls:
            pieces.append(CallPiece(call.id, call.name, call.arguments))
        self.calls += len(parsed.calls)
        return pieces

    def whole(self, completion: CompletionOutput) -> list[Piece]:
        """Every piece of a finished output."""
        if self.turn.tool_calls is not None:
            return self._forced(completion)
        parser = self.turn.parser
        if parser is None:
            return [TextPiece("content", completion.text)] if completion.text else []
        parsed = parser.whole(completion.text)
        pieces: list[Piece] = []
        if parsed.reasoning:
            pieces.append(TextPiece("reasoning", parsed.reasoning))
        if parsed.content:
            pieces.append(TextPiece("content", parsed.content))
        pieces += [CallPiece(c.id, c.name, c.arguments) for c in parsed.calls]
        self.calls += len(parsed.calls)
        return pieces

    def _forced(self, completion: CompletionOutput) -> list[Piece]:
        shape = self.turn.tool_calls
        assert shape is not None
        calls = shape.calls(completion.text) if completion.finish_reason == "stop" else None
        if calls is None:
            return [TextPiece("content", completion.text)] if completion.text else []
        self.calls += len(calls)
        return [
            CallPiece(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls
        ]
