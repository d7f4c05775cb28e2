"""OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`).

A Responses request is translated into the chat body `/v1/chat/completions` would be given for
the same conversation (`instructions` as the system message, input items as messages,
`function_call` / `function_call_output` items as the assistant's tool calls and their results,
`text.format` as `response_format`, flat function tools as chat tools), run as one chat turn
(`chat_turn.py`), and answered as a response object with output items (`reasoning`, `message`,
`function_call`) or as the typed event stream (`response.created` ... `response.completed`).

With `store` (the default, as OpenAI's), the response and the conversation it ends are kept in
the fleet's response store (`response_store.py`), so `previous_response_id` continues it on
whichever API server the next request reaches.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

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
from rankcast.api_server.errors import APIError
from rankcast.api_server.response_store import ResponseStore, StoredResponse
from rankcast.api_server.schema import (
    ChatCompletionRequest,
    RequestBody,
    TokenCount,
)
from rankcast.api_server.serving import (
    ENGINE_HEADER,
    ServingContext,
    live,
)
from rankcast.engine_client.mp_client import EngineDeadError
from rankcast.outputs import CompletionOutput, RequestRejectedError


class FunctionTool(BaseModel):
    """A function tool, in the Responses API's flat shape."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    type: Literal["function"]
    name: str = Field(min_length=1)


class PlainFormat(BaseModel):
    type: Literal["text", "json_object"]


class JsonSchemaTextFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    type: Literal["json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


TextFormat = Annotated[PlainFormat | JsonSchemaTextFormat, Field(discriminator="type")]


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormat | None = None


class ResponsesRequest(RequestBody):
    """`POST /v1/responses`."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: TokenCount | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    # Only foreground responses are served: the schema says so (`const`), and the validator
    # names the field in the 400.
    background: bool = Field(False, json_schema_extra={"const": False})

    @model_validator(mode="after")
    def _tools_for_the_choice(self) -> ResponsesRequest:
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError(f"tool_choice {self.tool_choice!r} needs tools")
        return self

    @field_validator("background")
    @classmethod
    def _foreground(cls, value: bool) -> bool:
        if value:
            raise ValueError("background responses are not supported")
        return value


def _part_text(part: dict[str, Any], where: str) -> str:
    kind = part.get("type")
    if kind not in ("input_text", "output_text", "text"):
        raise APIError(400, f"content part type {kind!r} is not supported", where)
    text = part.get("text")
    if not isinstance(text, str):
        raise APIError(400, "a text part needs text", where)
    return text


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input items as chat messages; consecutive function calls are one assistant turn."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(
                    400,
                    f"role {role!r} is not one of user, system, developer, assistant",
                    f"{where}.role",
                )
            content = item.get("content")
            if isinstance(content, str):
                text = content
            elif isinstance(content, list):
                text = "".join(
                    _part_text(p, f"{where}.content.{j}") if isinstance(p, dict) else ""
                    for j, p in enumerate(content)
                )
            else:
                raise APIError(400, "content must be text or a list of parts", f"{where}.content")
            messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            arguments = item.get("arguments", "{}")
            if not all(isinstance(v, str) for v in (call_id, name, arguments)):
                raise APIError(400, "a function_call needs call_id, name and arguments", where)
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not isinstance(output, str):
                raise APIError(400, "a function_call_output needs call_id and output", where)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            continue  # earlier reasoning is not given back to the model, as templates do
        else:
            raise APIError(400, f"input item type {kind!r} is not supported", f"{where}.type")
    return messages


def chat_body(body: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The `/v1/chat/completions` body of the same conversation and sampling."""
    messages = list(history) + input_messages(body.input)
    if body.instructions:
        messages.insert(0, {"role": "system", "content": body.instructions})
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stream": body.stream,
    }
    if body.tools:
        fields["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in body.tools
        ]
        choice = body.tool_choice
        if isinstance(choice, NamedFunction):
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif choice is not None:
            fields["tool_choice"] = choice
    fmt = body.text.format if body.text is not None else None
    if isinstance(fmt, JsonSchemaTextFormat):
        schema = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
        fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt is not None and fmt.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    return as_chat_request(fields)


class _Ids:
    """Item ids of one response (prefixes as OpenAI's)."""

    @staticmethod
    def of(kind: str) -> str:
        return f"{kind}_{uuid.uuid4().hex}"


def _item(piece: Piece, item_id: str, status: str = "completed") -> dict[str, Any]:
    if isinstance(piece, CallPiece):
        return {
            "type": "function_call",
            "id": item_id,
            "call_id": piece.id,
            "name": piece.name,
            "arguments": piece.arguments,
            "status": status,
        }
    if piece.kind == "reasoning":
        content = [{"type": "reasoning_text", "text": piece.text}]
        return {
            "type": "reasoning",
            "id": item_id,
            "summary": [],
            "content": content,
            "status": status,
        }
    part = {"type": "output_text", "text": piece.text, "annotations": [], "logprobs": []}
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [part],
    }


def _item_id(piece: Piece) -> str:
    if isinstance(piece, CallPiece):
        return _Ids.of("fc")
    return _Ids.of("rs" if piece.kind == "reasoning" else "msg")


def _output_messages(pieces: list[Piece]) -> list[dict[str, Any]]:
    """The response's output as the assistant turn a continuation is given."""
    content = "".join(p.text for p in pieces if isinstance(p, TextPiece) and p.kind == "content")
    calls = [
        {"id": p.id, "type": "function", "function": {"name": p.name, "arguments": p.arguments}}
        for p in pieces
        if isinstance(p, CallPiece)
    ]
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return [message]


class ResponseRun:
    """One response: the request, its turn, and the response object as it stands."""

    def __init__(
        self,
        body: ResponsesRequest,
        turn: ChatTurn,
        chat: ChatCompletionRequest,
        store: ResponseStore,
    ) -> None:
        self.body = body
        self.turn = turn
        self.chat = chat
        self.store = store
        self.created = int(time.time())

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        completion: CompletionOutput | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        body = self.body
        fmt = body.text.format if body.text is not None and body.text.format else None
        text_format = (
            {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True, exclude_none=True)
        )
        choice = body.tool_choice
        usage = None
        if completion is not None:
            prompt, generated = len(self.turn.prompt_ids), len(completion.token_ids)
            usage = {
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": generated,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + generated,
            }
        incomplete = None
        if status == "incomplete":
            incomplete = {"reason": "max_output_tokens"}
        return {
            "id": self.turn.request_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "model": self.turn.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": body.store,
            "temperature": body.temperature,
            "text": {"format": text_format},
            "tool_choice": choice.model_dump()
            if isinstance(choice, BaseModel)
            else (choice or "auto"),
            "tools": [t.model_dump() for t in body.tools or []],
            "top_p": body.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": None,
        }

    def finish(
        self, completion: CompletionOutput, pieces: list[Piece], output: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """The finished response, stored when the request asked for it."""
        status = "incomplete" if completion.finish_reason == "length" else "completed"
        response = self.response(status, output, completion)
        if self.body.store:
            # The conversation as the model saw it, less the instructions (a continuation
            # gives its own, as OpenAI's do), then this response's output.
            messages = [m.model_dump(exclude_none=True) for m in self.chat.messages]
            if self.body.instructions:
                messages = messages[1:]
            messages = [_plain(m) for m in messages] + _output_messages(pieces)
            self.store.put(self.turn.request_id, StoredResponse(response, messages))
        return response


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in message.items() if v is not None}


def start_response(
    ctx: ServingContext, store: ResponseStore, body: ResponsesRequest
) -> ResponseRun:
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise APIError(
                404,
                f"Previous response with id '{body.previous_response_id}' not found.",
                "previous_response_id",
            )
        history = previous.messages
    chat = chat_body(body, history)
    turn = start_chat(ctx, chat, _Ids.of("resp"))
    return ResponseRun(body, turn, chat, store)


async def create_response(
    ctx: ServingContext, store: ResponseStore, body: ResponsesRequest, request: Request
) -> Response:
    run = start_response(ctx, store, body)
    headers = {ENGINE_HEADER: str(run.turn.engine)}
    if body.stream:
        return StreamingResponse(
            _response_events(run), media_type="text/event-stream", headers=headers
        )
    completion = await run_to_end(run.turn, request)
    if completion is None:
        return Response(status_code=499)
    pieces = TurnReader(run.turn).whole(completion)
    items = [_item(p, _item_id(p)) for p in pieces]
    return JSONResponse(run.finish(completion, pieces, items), headers=headers)


def stored_response(store: ResponseStore, response_id: str) -> dict[str, Any]:
    stored = store.get(response_id)
    if stored is None:
        raise APIError(404, f"Response with id '{response_id}' not found.", "response_id")
    return stored.response


_json = msgspec.json.Encoder()


class _Events:
    """The numbered event stream of one response."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **payload: Any) -> bytes:
        event = {"type": kind, "sequence_number": self.sequence, **payload}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + _json.encode(event) + b"\n\n"


async def _response_events(run: ResponseRun) -> AsyncIterator[bytes]:
    """The typed event sequence: an item is opened by its first piece (`output_item.added`,
    and for a message its `content_part.added`), its text streamed as deltas, and closed
    (`..done` events) when a piece of another kind comes or the output ends; a function call
    is opened, given its arguments in one delta, and closed at once."""
    event = _Events()
    yield event("response.created", response=run.response("in_progress", [])) + event(
        "response.in_progress", response=run.response("in_progress", [])
    )
    reader = TurnReader(run.turn)
    items: list[dict[str, Any]] = []
    pieces: list[Piece] = []
    open_piece: TextPiece | None = None  # the text item being streamed, its text so far
    open_id = ""

    def close() -> bytes:
        nonlocal open_piece
        if open_piece is None:
            return b""
        index, piece, open_piece = len(items), open_piece, None
        item = _item(piece, open_id)
        items.append(item)
        if piece.kind == "reasoning":
            out = event(
                "response.reasoning_text.done",
                item_id=open_id, output_index=index, content_index=0, text=piece.text,
            )  # fmt: skip
        else:
            out = event(
                "response.output_text.done",
                item_id=open_id, output_index=index, content_index=0, text=piece.text,
                logprobs=[],
            ) + event(
                "response.content_part.done",
                item_id=open_id, output_index=index, content_index=0,
                part=item["content"][0],
            )  # fmt: skip
        return out + event("response.output_item.done", output_index=index, item=item)

    def emit(piece: Piece) -> bytes:
        nonlocal open_piece, open_id
        pieces.append(piece)
        index = len(items)
        if isinstance(piece, CallPiece):
            out = close()
            index = len(items)
            item_id = _item_id(piece)
            started = {**_item(piece, item_id, "in_progress"), "arguments": ""}
            item = _item(piece, item_id)
            items.append(item)
            return out + (
                event("response.output_item.added", output_index=index, item=started)
                + event(
                    "response.function_call_arguments.delta",
                    item_id=item_id, output_index=index, delta=piece.arguments,
                )
                + event(
                    "response.function_call_arguments.done",
                    item_id=item_id, output_index=index, name=piece.name,
                    arguments=piece.arguments,
                )
                + event("response.output_item.done", output_index=index, item=item)
            )  # fmt: skip
        out = b""
        if open_piece is None or open_piece.kind != piece.kind:
            out += close()
            index = len(items)
            open_id = _item_id(piece)
            open_piece = TextPiece(piece.kind, "")
            started = _item(open_piece, open_id, "in_progress")
            if piece.kind == "reasoning":
                started["content"] = []
                out += event("response.output_item.added", output_index=index, item=started)
            else:
                part = started["content"].pop()
                out += event(
                    "response.output_item.added", output_index=index, item=started
                ) + event(
                    "response.content_part.added",
                    item_id=open_id, output_index=index, content_index=0, part=part,
                )  # fmt: skip
        open_piece = TextPiece(piece.kind, open_piece.text + piece.text)
        kind = "reasoning_text" if piece.kind == "reasoning" else "output_text"
        extra: dict[str, Any] = {} if piece.kind == "reasoning" else {"logprobs": []}
        return out + event(
            f"response.{kind}.delta",
            item_id=open_id, output_index=index, content_index=0, delta=piece.text, **extra,
        )  # fmt: skip

    completion: CompletionOutput | None = None
    try:
        async for output in run.turn.outputs:
            completion = output.outputs[0]
            events = b"".join(emit(piece) for piece in reader.feed(output))
            if events:
                yield events
    except (EngineDeadError, RequestRejectedError, ServerShuttingDownError) as exc:
        code = "invalid_request" if isinstance(exc, RequestRejectedError) else "server_error"
        error = {"code": code, "message": str(exc)}
        yield (
            close()
            + event("error", code=code, message=str(exc), param=None)
            + event("response.failed", response=run.response("failed", items, error=error))
        )
        return
    assert completion is not None
    tail = close()
    final = run.finish(completion, pieces, items)
    kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
    yield tail + event(kind, response=final)


def add_responses_routes(app: FastAPI, serving: ServingContext) -> None:
    store = ResponseStore()

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await create_response(live(serving), store, body, request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        """A stored response, from whichever API server of the fleet stored it."""
        return stored_response(store, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        if not store.delete(response_id):
            raise APIError(404, f"Response with id '{response_id}' not found.", "response_id")
        return {"id": response_id, "object": "response", "deleted": True}
