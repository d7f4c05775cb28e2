"""Request bodies of the OpenAI-compatible endpoints, validated by pydantic.

Range checks live here so that a bad value is a 400 naming the field before anything reaches the
engine. Fields production engines accept beyond OpenAI's (`top_k`, `min_p`, `ignore_eos`) are
accepted too.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

# What msgpack (the engine's wire) and torch's seeds can carry.
INT_MIN, INT_MAX, UINT_MAX = -(2**63), 2**63 - 1, 2**64 - 1


# The bounds as the published schema states them. JSON Schema tools read numbers as doubles, in
# which 2**63 - 1 and 2**64 - 1 do not exist: a schema-driven client rounds them up and sends a
# value past them. The schema gives the largest doubles within the bounds (the few integers
# between those and the real bounds are served all the same).
_DOCUMENTED_INT_MAX = 2**63 - 1024
_DOCUMENTED_UINT_MAX = 2**64 - 2048

# A count of tokens (max_tokens and its kin).
TokenCount = Annotated[
    int,
    Field(ge=1, le=INT_MAX),
    WithJsonSchema({"type": "integer", "minimum": 1, "maximum": _DOCUMENTED_INT_MAX}),
]
# top_k: -1 or 0 turn it off.
TopK = Annotated[
    int,
    Field(ge=-1, le=INT_MAX),
    WithJsonSchema({"type": "integer", "minimum": -1, "maximum": _DOCUMENTED_INT_MAX}),
]
# torch's generators take any seed in [-2**63, 2**64 - 1].
Seed = Annotated[
    int,
    Field(ge=INT_MIN, le=UINT_MAX),
    WithJsonSchema({"type": "integer", "minimum": INT_MIN, "maximum": _DOCUMENTED_UINT_MAX}),
]


def unrepresentable(value: Any, path: str = "body") -> str | None:
    """Why a parsed JSON body holds something no part of the engine can carry, naming where;
    None when it is plain data: text that is valid Unicode (JSON's `\\ud800` escapes can make a
    lone UTF-16 surrogate, which neither the tokenizer nor UTF-8 accepts), integers that fit
    in 64 bits, finite numbers (Python's JSON parser accepts NaN and Infinity)."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        kind = type(item)
        if kind is str:
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError as exc:
                    bad = item[exc.start]
                    return (
                        f"{where}: text is not valid Unicode (a lone UTF-16 surrogate, {bad!a}, "
                        f"at position {exc.start})"
                    )
        elif kind is int:
            if not INT_MIN <= item <= UINT_MAX:
                return f"{where}: integer outside the 64-bit range"
        elif kind is float:
            if not math.isfinite(item):
                return f"{where}: {item} is not a finite number (NaN and infinities are refused)"
        elif kind is list:
            stack.extend((v, f"{where}[{i}]") for i, v in reversed(list(enumerate(item))))
        elif kind is dict:
            for key, v in reversed(list(item.items())):
                problem = unrepresentable(key, f"{where} key") if type(key) is str else None
                if problem is not None:
                    return problem
                stack.append((v, f"{where}.{key}" if where != "body" else str(key)))
    return None


class RequestBody(BaseModel):
    """Every request body: checked as plain data before its fields are, so an unrepresentable
    value anywhere (extra fields and free-form arguments included) is a 400 naming where it is,
    not an error deep in the tokenizer or the engine's encoder."""

    @model_validator(mode="before")
    @classmethod
    def _plain_data(cls, data: Any) -> Any:
        problem = unrepresentable(data)
        if problem is not None:
            raise ValueError(problem)
        return data


# A choice of a `choice` shape: the grammar cannot match an empty one.
NonEmptyText = Annotated[str, Field(min_length=1)]
# A token id: what the schema can say of it statically (the vocabulary's size is added to the
# served schema by the app, which knows it).
TokenId = Annotated[int, Field(ge=0)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    """A content part: text is the only kind this server's models read (images, audio and
    files are refused by the schema, naming where they are)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        """Plain text of the message."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: the schema is enforced whatever `strict` says."""

    model_config = ConfigDict(populate_by_name=True)

    name: str = Field("response", min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        schema = self.json_schema.schema_ if self.json_schema is not None else None
        if self.type == "json_schema" and schema is None:
            raise ValueError("response_format json_schema needs json_schema.schema")
        return self


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` object (its successor to the `guided_*` fields)."""

    model_config = ConfigDict(extra="forbid")

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[NonEmptyText] | None = Field(None, min_length=1)
    grammar: str | None = None


class _SamplingFields(RequestBody):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: TokenCount | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: TopK | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Samples of the prompt, each a choice (parallel_sampling.py); OpenAI's bound.
    n: int = Field(1, ge=1, le=128)
    ignore_eos: bool = False
    # Structured outputs: at most one of these (`structured.py` turns it into a grammar).
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[NonEmptyText] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsField | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        if value is None:
            return []
        stops = [value] if isinstance(value, str) else value
        if len(stops) > 16 or any(not s for s in stops):
            raise ValueError("stop must be up to 16 non-empty strings")
        return stops


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str = Field(min_length=1)


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


# What the chat template is given itself; `chat_template_kwargs` cannot set these
# (rankcast/chat_template.py's RESERVED_VARIABLES).
_TEMPLATE_OWN = ("messages", "tools", "documents", "add_generation_prompt")


def _template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    taken = [name for name in value or {} if name in _TEMPLATE_OWN]
    if taken:
        raise ValueError(
            f"cannot set {', '.join(map(repr, taken))}: the request's own fields give the "
            "template those"
        )
    return value


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    max_completion_tokens: TokenCount | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # More variables for the chat template (vLLM's field), e.g. {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] | None = None

    _template_kwargs = field_validator("chat_template_kwargs")(_template_kwargs)

    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_SamplingFields):
    # Text, token ids, or a list of one text (what the openai client sends for a string).
    prompt: (
        NonEmptyText
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[NonEmptyText], Field(min_length=1, max_length=1)]
    )
    max_tokens: TokenCount | None = 16
    logprobs: int | None = Field(None, ge=0, le=20)
    # The prompt's text before the completion's (vLLM's and OpenAI's legacy `echo`).
    echo: bool = False
    # Samples drawn, of which the `n` most likely are answered (OpenAI's legacy `best_of`).
    best_of: int | None = Field(None, ge=1, le=128)

    @model_validator(mode="after")
    def _best_of_n(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of cannot stream: the best samples are known only at the end")
        return self

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(value, list) and value and isinstance(value[0], str):
            if len(value) != 1:
                raise ValueError("only one prompt per request is supported")
            return value[0]
        if isinstance(value, list) and not value:
            raise ValueError("the prompt is empty")
        return cast(str | list[int], value)  # a list of strings returned above


class TokenizeRequest(RequestBody):
    """`POST /tokenize`, in vLLM's shape: a completion `prompt`, or chat `messages` rendered by
    the model's template. `add_special_tokens` defaults as vLLM's does: on for a prompt (what a
    completion request adds), off for messages (the template writes its own)."""

    # The schema says what the validator below checks: a prompt or messages, not both.
    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={
            "oneOf": [
                {
                    "required": ["prompt"],
                    "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}},
                },
                {
                    "required": ["messages"],
                    "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}},
                },
            ]
        },
    )

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    _template_kwargs = field_validator("chat_template_kwargs")(_template_kwargs)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(RequestBody):
    """`POST /detokenize`, in vLLM's shape."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[TokenId]


class CollectiveRpcRequest(RequestBody):
    """Call a worker-extension method on every rank (`POST /collective_rpc`)."""

    model_config = ConfigDict(extra="forbid")

    method: str = Field(min_length=1)
    args: list[Any] = Field(default_factory=list)
    timeout: float | None = Field(default=None, gt=0, allow_inf_nan=False)


class LoadLoRAAdapterRequest(RequestBody):
    """`POST /v1/load_lora_adapter` (only with --allow-runtime-lora-updating)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)

    @field_validator("lora_path")
    @classmethod
    def _a_path_the_file_system_takes(cls, value: str) -> str:
        # Checked here, not where the path is opened: that raises a bare ValueError.
        if "\x00" in value:
            raise ValueError(f"contains a NUL byte at {value.index(chr(0))}; no file path can")
        return value


class UnloadLoRAAdapterRequest(RequestBody):
    """`POST /v1/unload_lora_adapter` (only with --allow-runtime-lora-updating)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1)


class PinLoRAAdapterRequest(RequestBody):
    """`POST /v1/pin_lora_adapter` and `/v1/unpin_lora_adapter` (with runtime updating)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
