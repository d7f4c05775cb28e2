"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`).

A Messages request is translated into the chat body `/v1/chat/completions` would be given for
the same conversation (system prompt first, `tool_use` blocks as the assistant's tool calls,
`tool_result` blocks as tool messages, `tools` as function tools, `tool_choice` any/tool as
forced calls), run as one chat turn (`chat_turn.py`), and answered in Anthropic's shapes: a
message with content blocks, or its event stream (`message_start`, `content_block_start`,
deltas, `content_block_stop`, `message_delta`, `message_stop`). What this API has that rankcast
does not serve (images, documents, server tools, citations) is a 400 naming the field.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from rankcast.api_server.chat_turn import (
    CallPiece,
    ChatTurn,
    Piece,
    TextPiece,
    TurnReader,
    as_chat_request,
    run_to_end,
    start_chat,
)
from rankcast.api_server.drain import ServerShuttingDownError
from rankcast.api_server.errors import anthropic_error_body
from rankcast.api_server.schema import (
    ChatCompletionRequest,
    NonEmptyText,
    RequestBody,
    TokenCount,
    TopK,
)
from rankcast.api_server.serving import (
    ENGINE_HEADER,
    ServingContext,
    chat_prompt,
    check_model,
    live,
)
from rankcast.engine_client.mp_client import EngineDeadError
from rankcast.outputs import CompletionOutput, RequestRejectedError


class TextBlock(BaseModel):
    """Text: what a system prompt and a tool result hold, and any turn may."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    """A call the assistant made (given back in a later request's history)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    """What a call returned, in the user's turn."""

    model_config = ConfigDict(extra="allow")

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None


class ThinkingBlock(BaseModel):
    """Earlier reasoning given back: not shown to the model again, as chat templates do."""

    model_config = ConfigDict(extra="allow")

    type: Literal["thinking", "redacted_thinking"]


# What each role's content may hold, told apart by `type`; any other kind (images, documents,
# server tools) is a 400 naming where it is, and the schema says so.
UserBlock = Annotated[TextBlock | ToolResultBlock, Field(discriminator="type")]
AssistantBlock = Annotated[TextBlock | ToolUseBlock | ThinkingBlock, Field(discriminator="type")]


class UserMessage(BaseModel):
    role: Literal["user"]
    content: str | list[UserBlock]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | list[AssistantBlock]


InputMessage = Annotated[UserMessage | AssistantMessage, Field(discriminator="role")]


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class ToolChoiceKind(BaseModel):
    """`auto` (the model decides), `any` (some tool must be called) or `none`."""

    type: Literal["auto", "any", "none"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNamed(BaseModel):
    """`tool`: this one must be called."""

    type: Literal["tool"]
    name: str = Field(min_length=1)
    disable_parallel_tool_use: bool | None = None


ToolChoice = Annotated[ToolChoiceKind | ToolChoiceNamed, Field(discriminator="type")]


class Thinking(BaseModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class JsonOutputFormat(BaseModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """`output_config`: `format` is a JSON schema the answer follows (structured outputs);
    `effort` has no meaning for a model without a thinking budget and is ignored."""

    model_config = ConfigDict(extra="ignore")

    format: JsonOutputFormat | None = None


class CountTokensRequest(RequestBody):
    """`POST /v1/messages/count_tokens`: the conversation whose prompt is counted."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`."""

    max_tokens: TokenCount
    stop_sequences: list[NonEmptyText] | None = Field(None, max_length=16)
    temperature: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: TopK | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None


def _text_of(blocks: str | list[TextBlock] | None) -> str:
    """The text of a string or of text blocks (the schema takes no other kind there)."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    return "".join(block.text for block in blocks)


def _chat_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages, in order."""
    messages: list[dict[str, Any]] = []
    system = _text_of(body.system)
    if system:
        messages.append({"role": "system", "content": system})
    for message in body.messages:
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for block in message.content:
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ToolUseBlock):
                function = {"name": block.name, "arguments": json.dumps(block.input)}
                calls.append({"id": block.id, "type": "function", "function": function})
            elif isinstance(block, ToolResultBlock):
                result = _text_of(block.content)
                messages.append(
                    {"role": "tool", "tool_call_id": block.tool_use_id, "content": result}
                )
        # A turn of only tool results is those; an empty one is still a turn.
        if texts or calls or not message.content or message.role == "assistant":
            entry: dict[str, Any] = {"role": message.role, "content": "".join(texts)}
            if calls:
                entry["tool_calls"] = calls
            messages.append(entry)
    return messages


def chat_body(body: CountTokensRequest, stream: bool = False) -> ChatCompletionRequest:
    """The `/v1/chat/completions` body of the same conversation and sampling."""
    fields: dict[str, Any] = {"model": body.model, "messages": _chat_messages(body)}
    if body.tools:
        fields["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.input_schema,
                },
            }
            for t in body.tools
        ]
        choice = body.tool_choice
        if isinstance(choice, ToolChoiceNamed):
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            kind = choice.type if choice is not None else "auto"
            fields["tool_choice"] = {"any": "required"}.get(kind, kind)
    if body.thinking is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": body.thinking.type != "disabled"}
    if isinstance(body, MessagesRequest):
        fields.update(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            stop=body.stop_sequences or None,
            stream=stream,
        )
        fmt = body.output_config.format if body.output_config is not None else None
        if fmt is not None:
            schema = {"name": "output", "schema": fmt.schema_}
            fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    return as_chat_request(fields)


def count_tokens(ctx: ServingContext, body: CountTokensRequest) -> dict[str, int]:
    check_model(ctx, body.model)
    _, prompt_ids = chat_prompt(ctx, chat_body(body))
    return {"input_tokens": len(prompt_ids)}


def _stop(completion: CompletionOutput, calls: int) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for a finished output."""
    if calls:
        return "tool_use", None
    if completion.finish_reason == "length":
        return "max_tokens", None
    if isinstance(completion.stop_reason, str):
        return "stop_sequence", completion.stop_reason
    return "end_turn", None


def _block(piece: Piece) -> dict[str, Any]:
    if isinstance(piece, CallPiece):
        return {"type": "tool_use", "id": piece.id, "name": piece.name, "input": _input(piece)}
    if piece.kind == "reasoning":
        return {"type": "thinking", "thinking": piece.text, "signature": ""}
    return {"type": "text", "text": piece.text}


def _input(call: CallPiece) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's `input` is (the JSON a grammar or the
    parser checked; anything else is kept whole under `arguments`)."""
    try:
        value = json.loads(call.arguments)
    except json.JSONDecodeError:
        return {"arguments": call.arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def _message(turn: ChatTurn, usage: dict[str, int]) -> dict[str, Any]:
    return {
        "id": turn.request_id,
        "type": "message",
        "role": "assistant",
        "model": turn.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }


async def create_message(ctx: ServingContext, body: MessagesRequest, request: Request) -> Response:
    turn = start_chat(ctx, chat_body(body, body.stream), f"msg_{uuid.uuid4().hex}")
    headers = {ENGINE_HEADER: str(turn.engine)}
    if body.stream:
        return StreamingResponse(
            _message_events(turn), media_type="text/event-stream", headers=headers
        )
    completion = await run_to_end(turn, request)
    if completion is None:
        return Response(status_code=499)
    reader = TurnReader(turn)
    pieces = reader.whole(completion)
    stop_reason, stop_sequence = _stop(completion, reader.calls)
    usage = {"input_tokens": len(turn.prompt_ids), "output_tokens": len(completion.token_ids)}
    message = _message(turn, usage)
    message.update(
        content=[_block(p) for p in pieces],
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
    )
    return JSONResponse(message, headers=headers)


_json = msgspec.json.Encoder()


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    return (
        b"event: " + kind.encode() + b"\ndata: " + _json.encode({"type": kind, **payload}) + b"\n\n"
    )


async def _message_events(turn: ChatTurn) -> AsyncIterator[bytes]:
    """Anthropic's event sequence. A block is opened by its first piece and closed when a
    piece of another kind (or the end) comes; a tool call is one block, opened with its name
    and given its arguments in one `input_json_delta`."""
    usage = {"input_tokens": len(turn.prompt_ids), "output_tokens": 0}
    yield _event("message_start", {"message": _message(turn, usage)})
    reader = TurnReader(turn)
    index = -1
    open_kind: str | None = None
    completion: CompletionOutput | None = None

    def close() -> bytes:
        nonlocal open_kind
        if open_kind is None:
            return b""
        open_kind = None
        return _event("content_block_stop", {"index": index})

    def emit(piece: Piece) -> bytes:
        nonlocal index, open_kind
        out = b""
        if isinstance(piece, CallPiece):
            out += close()
            index += 1
            block = {"type": "tool_use", "id": piece.id, "name": piece.name, "input": {}}
            out += _event("content_block_start", {"index": index, "content_block": block})
            delta = {"type": "input_json_delta", "partial_json": piece.arguments}
            out += _event("content_block_delta", {"index": index, "delta": delta})
            return out + _event("content_block_stop", {"index": index})
        kind = "thinking" if piece.kind == "reasoning" else "text"
        if open_kind != kind:
            out += close()
            index += 1
            open_kind = kind
            start = {"type": "thinking", "thinking": "", "signature": ""}
            if kind == "text":
                start = {"type": "text", "text": ""}
            out += _event("content_block_start", {"index": index, "content_block": start})
        delta = {"type": "thinking_delta", "thinking": piece.text}
        if kind == "text":
            delta = {"type": "text_delta", "text": piece.text}
        return out + _event("content_block_delta", {"index": index, "delta": delta})

    try:
        async for output in turn.outputs:
            completion = output.outputs[0]
            events = b"".join(emit(piece) for piece in reader.feed(output))
            if events:
                yield events
    except (EngineDeadError, RequestRejectedError, ServerShuttingDownError) as exc:
        status = 400 if isinstance(exc, RequestRejectedError) else 503
        yield close() + _event("error", anthropic_error_body(status, str(exc)))
        return
    assert completion is not None
    stop_reason, stop_sequence = _stop(completion, reader.calls)
    if index < 0:  # no output at all: one empty text block, as Anthropic's answers have
        yield emit(TextPiece("content", ""))
    usage = {"output_tokens": len(completion.token_ids)}
    delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
    yield (
        close()
        + _event("message_delta", {"delta": delta, "usage": usage})
        + _event("message_stop", {})
    )


def add_messages_routes(app: FastAPI, serving: ServingContext) -> None:
    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        return await create_message(live(serving), body, request)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(body: CountTokensRequest) -> dict[str, int]:
        return count_tokens(live(serving), body)
