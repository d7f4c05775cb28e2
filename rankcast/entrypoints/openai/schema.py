"""Request bodies of the OpenAI-compatible endpoints, validated by pydantic.

Range checks live here so that a bad value is a 400 naming the field before anything reaches the
engine. Fields production engines accept beyond OpenAI's (`top_k`, `min_p`, `ignore_eos`) are
accepted too.
"""

from __future__ import annotations

from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """Plain text of the message; content parts other than text are rejected."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"content part type {part.get('type')!r} is not supported")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="only n=1 is supported")
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        if value is None:
            return []
        stops = [value] if isinstance(value, str) else value
        if len(stops) > 16 or any(not s for s in stops):
            raise ValueError("stop must be up to 16 non-empty strings")
        return stops


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False

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

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
        return value


class CollectiveRpcRequest(BaseModel):
    """Call a worker-extension method on every rank (`POST /collective_rpc`)."""

    model_config = ConfigDict(extra="forbid")

    method: str = Field(min_length=1)
    args: list[Any] = Field(default_factory=list)
    timeout: float | None = Field(default=None, gt=0)


class LoadLoRAAdapterRequest(BaseModel):
    """`POST /v1/load_lora_adapter` (only with --allow-runtime-lora-updating)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    """`POST /v1/unload_lora_adapter` (only with --allow-runtime-lora-updating)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1)


class PinLoRAAdapterRequest(BaseModel):
    """`POST /v1/pin_lora_adapter` and `/v1/unpin_lora_adapter` (with runtime updating)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
