"""Structured outputs through a real `rankcast serve` of the embedded model, driven by the
official openai client: response_format, vLLM's guided fields and forced tool calls."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.entrypoints.server_process import ServerProcess

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 20}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--max-model-len", "1024", "--kv-cache-space", "0.25", api_server_count=1)
    with proc.running():
        yield proc


@pytest.fixture()
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def test_response_format_json_schema(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            "genres": {
                "type": "array",
                "items": {"enum": ["drama", "comedy", "sci-fi"]},
                "maxItems": 3,
            },
        },
        "required": ["title", "year", "genres"],
        "additionalProperties": False,
    }
    response = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Recommend a film."}],
        max_tokens=120,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "film", "schema": schema, "strict": True},
        },
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert choice.message.content is not None
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_response_format_json_object(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Describe a dog in JSON."}],
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
    )
    content = response.choices[0].message.content
    assert content is not None and content.startswith("{")
    if response.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


def test_guided_regex_and_choice_on_completions(client: openai.OpenAI) -> None:
    date = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="The moon landing happened on",
        max_tokens=20,
        temperature=0,
        extra_body={"guided_regex": r" [0-9]{4}-[0-9]{2}-[0-9]{2}"},
    )
    assert re.fullmatch(r" [0-9]{4}-[0-9]{2}-[0-9]{2}", date.choices[0].text)
    assert date.choices[0].finish_reason == "stop"
    mood = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="Review: I loved it. Sentiment:",
        max_tokens=5,
        temperature=0,
        extra_body={"structured_outputs": {"choice": [" positive", " negative"]}},
    )
    assert mood.choices[0].text in (" positive", " negative")


def _validate_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), PARAMETERS[name])


def test_tool_choice_required_gives_calls_that_validate(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=ASK,  # type: ignore[arg-type]
        max_tokens=200,
        temperature=0,
        tools=TOOLS,
        tool_choice="required",
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert calls, "tool_choice required must give at least one call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        _validate_call(call.function.name, call.function.arguments)


def test_named_function_gives_its_arguments(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=ASK,  # type: ignore[arg-type]
        max_tokens=120,
        temperature=0,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    _validate_call("get_weather", call.function.arguments)


def test_streamed_tool_call_arrives_whole(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=ASK,  # type: ignore[arg-type]
        max_tokens=120,
        temperature=0,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        stream=True,
    )
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            assert call.function is not None
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        assert not delta.content, "a forced tool call streams no content"
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    assert list(calls) == [0] and calls[0]["name"] == "get_time"
    _validate_call("get_time", calls[0]["arguments"])
