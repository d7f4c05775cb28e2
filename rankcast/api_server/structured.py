"""The shape a chat or completion request asks its output to take, and tool calls.

A request may name one shape, in any of the dialects clients use: OpenAI's `response_format`,
vLLM's `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` and its newer
`structured_outputs` object, or tools with `tool_choice` set to `required` or a named function
(the output is then JSON the tool-call shape below turns into `tool_calls`). Two shapes in one
request, a schema llguidance cannot build, or `tool_choice: auto` on a server without a parser
of the model's own tool-call format (`--enable-auto-tool-choice --tool-call-parser`;
`output_parsers.py` reads the calls) are a 400 naming the field.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from rankcast.api_server.errors import APIError
from rankcast.api_server.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    Tool,
)
from rankcast.structured_outputs import StructuredOutputs


@dataclass(frozen=True)
class ToolCallShape:
    """How a tool-forcing request's output becomes tool calls: for a named function the
    output is that function's arguments; for `required` it is a JSON list of
    `{"name": ..., "parameters": {...}}`, one per call (vLLM's shape)."""

    function: str | None  # the named function, or None for `required`

    @property
    def finish_reason(self) -> str:
        # OpenAI's: a forced named function finishes with "stop", a required choice with
        # "tool_calls".
        return "stop" if self.function is not None else "tool_calls"

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The tool calls `text` holds, in the response's shape; None when it holds none (an
        output cut short by max_tokens is not valid JSON: it is returned as content)."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        if self.function is not None:
            pairs = [(self.function, value)]
        else:
            if not isinstance(value, list) or not all(isinstance(c, dict) for c in value):
                return None
            pairs = [(call.get("name"), call.get("parameters")) for call in value]
        return [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
            for name, arguments in pairs
        ]


def requested_shape(
    body: ChatCompletionRequest | CompletionRequest, auto_tool_choice: bool = False
) -> tuple[StructuredOutputs | None, ToolCallShape | None]:
    """The grammar the request's output must follow (None: free text), and for forced tool
    calls how to read the output back. `auto_tool_choice`: the server parses the calls a
    model writes itself, so tools with `tool_choice` auto leave the output free."""
    asked: list[tuple[str, dict[str, Any]]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        assert fmt.json_schema is not None  # the schema model checks it is there
        asked.append(("response_format", {"json": fmt.json_schema.schema_}))
    for field, kind in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(body, field)
        if value is not None:
            asked.append((field, {kind: value}))
    if body.structured_outputs is not None:
        given = body.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        asked.append(("structured_outputs", given))
    tools: ToolCallShape | None = None
    if isinstance(body, ChatCompletionRequest) and body.tools:
        tool_shape = _tool_shape(body.tools, body.tool_choice, auto_tool_choice)
        if tool_shape is not None:
            tools, grammar = tool_shape
            asked.append(("tools", grammar))
    if not asked:
        return None, None
    if len(asked) > 1:
        named = ", ".join(field for field, _ in asked)
        raise APIError(400, f"give at most one output shape, got {named}", asked[1][0])
    field, spec = asked[0]
    try:
        return StructuredOutputs(**spec), tools
    except (TypeError, ValueError) as exc:
        raise APIError(400, f"{field}: {exc}", field) from None


def auto_tools(body: ChatCompletionRequest) -> bool:
    """Whether the request leaves calling its tools to the model (`tool_choice` auto, the
    default when tools are given)."""
    return bool(body.tools) and body.tool_choice in (None, "auto")


def _tool_shape(
    tools: list[Tool], choice: str | NamedToolChoice | None, auto_tool_choice: bool
) -> tuple[ToolCallShape, dict[str, Any]] | None:
    """The tool-call shape and its grammar spec; None when tools do not constrain the output."""
    if choice == "none":
        return None
    if choice is None or choice == "auto":
        if auto_tool_choice:
            return None
        raise APIError(
            400,
            "tool_choice 'auto' (the default when tools are given) needs a parser of the "
            "model's own tool-call format, which this server was not started with "
            "(--enable-auto-tool-choice --tool-call-parser hermes); use tool_choice "
            "'required', a named function, or 'none'",
            "tool_choice",
        )
    if isinstance(choice, NamedToolChoice):
        named = next((t for t in tools if t.function.name == choice.function.name), None)
        if named is None:
            raise APIError(
                400, f"tool_choice names {choice.function.name!r}, which is not in tools", "tools"
            )
        return ToolCallShape(named.function.name), {"json": _parameters(named)}
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "parameters": _parameters(t)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    return ToolCallShape(None), {"json": schema}


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}
