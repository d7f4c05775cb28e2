"""`/v1/responses` and `/v1/messages` through a real `rankcast serve` (two API servers), driven
by the official `openai` and `anthropic` clients, whose stream parsers raise on a malformed
event sequence.

The same conversation through the three chat-shaped APIs must give the same prompt and the
same greedy text; a stored response must continue on the other API server; forced tool calls
come from the structured-output machinery (the model is real, its output constrained).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.entrypoints.server_process import ServerProcess

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"
GREEDY: dict[str, Any] = {"temperature": 0}
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "--api-key", API_KEY, "--max-model-len", "1024", "--kv-cache-space", "0.25"
    )  # fmt: skip
    with proc.running():
        yield proc


def _openai(server: ServerProcess) -> openai.OpenAI:
    # A client of its own each time: a fresh connection, which the kernel may give to
    # either API server.
    return openai.OpenAI(
        base_url=f"{server.url}/v1",
        api_key=API_KEY,
        max_retries=0,
        timeout=120,
        http_client=httpx.Client(),
    )


def _anthropic(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


def _on_server(server: ServerProcess, call: Any, wanted: str | None = None) -> tuple[str, Any]:
    """Run `call(client)` (a `with_raw_response` call) on fresh clients until an API server
    other than `wanted`'s complement answers: `wanted` None takes any; the answering server's
    index and the parsed result."""
    deadline = time.monotonic() + 60
    while True:
        raw = call(_openai(server))
        answered = raw.headers["x-rankcast-api-server"]
        if wanted is None or answered == wanted:
            return answered, raw.parse()
        assert time.monotonic() < deadline, f"server {wanted} never answered"


def test_the_three_apis_give_one_prompt_and_one_greedy_text(server: ServerProcess) -> None:
    client = _openai(server)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": QUESTION},
        ],
        max_tokens=24,
        **GREEDY,
    )
    response = client.responses.create(
        model=MODEL, instructions="Answer briefly.", input=QUESTION, max_output_tokens=24, **GREEDY
    )
    claude = _anthropic(server)
    message = claude.messages.create(
        model=MODEL,
        system="Answer briefly.",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=24,
        extra_body=GREEDY,
    )
    counted = claude.messages.count_tokens(
        model=MODEL, system="Answer briefly.", messages=[{"role": "user", "content": QUESTION}]
    )
    text = chat.choices[0].message.content
    assert text
    assert response.output_text == text
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == text  # type: ignore[union-attr]
    assert chat.usage is not None and response.usage is not None
    prompt_tokens = chat.usage.prompt_tokens
    assert response.usage.input_tokens == message.usage.input_tokens == prompt_tokens
    assert counted.input_tokens == prompt_tokens
    assert response.usage.output_tokens == message.usage.output_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.status == "completed" and message.stop_reason == "end_turn"
    assert response.object == "response" and response.id.startswith("resp_")
    assert message.role == "assistant" and message.model == MODEL


def test_a_streamed_response_is_the_sdks_event_sequence(server: ServerProcess) -> None:
    client = _openai(server)
    whole = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=40, **GREEDY)
    with client.responses.stream(
        model=MODEL, input=QUESTION, max_output_tokens=40, **GREEDY
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == whole.output_text
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == whole.output_text

    cut = list(
        client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=3, stream=True)
    )
    assert cut[-1].type == "response.incomplete"
    assert cut[-1].response.status == "incomplete"
    assert cut[-1].response.incomplete_details.reason == "max_output_tokens"
    assert cut[-1].response.usage.output_tokens == 3


def test_a_forced_function_call_continues_on_the_other_api_server(server: ServerProcess) -> None:
    tools: list[Any] = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": WEATHER_SCHEMA,
        }
    ]
    first_server, called = _on_server(
        server,
        lambda c: c.responses.with_raw_response.create(
            model=MODEL, input="What is the weather in Paris?", tools=tools,
            tool_choice="required", max_output_tokens=64, **GREEDY,
        ),
    )  # fmt: skip
    [call] = called.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    assert call.call_id and call.id.startswith("fc_")

    other = "1" if first_server == "0" else "0"
    _, answered = _on_server(
        server,
        lambda c: c.responses.with_raw_response.create(
            model=MODEL, previous_response_id=called.id, max_output_tokens=24,
            input=[{"type": "function_call_output", "call_id": call.call_id,
                    "output": '{"temperature": "21 C", "sky": "clear"}'}],
            **GREEDY,
        ),
        wanted=other,
    )  # fmt: skip
    assert answered.status in ("completed", "incomplete")
    assert answered.previous_response_id == called.id
    assert answered.output_text

    # The stored conversation is what the continuation was given: the same three turns
    # written out as input items give the same text.
    _, replayed = _on_server(
        server,
        lambda c: c.responses.with_raw_response.create(
            model=MODEL, max_output_tokens=24, store=False, **GREEDY,
            input=[
                {"role": "user", "content": "What is the weather in Paris?"},
                {"type": "function_call", "call_id": call.call_id, "name": call.name,
                 "arguments": call.arguments},
                {"type": "function_call_output", "call_id": call.call_id,
                 "output": '{"temperature": "21 C", "sky": "clear"}'},
            ],
        ),
    )  # fmt: skip
    assert replayed.output_text == answered.output_text

    # Retrieved from the server that did not store it; a store: false response is not kept.
    _, retrieved = _on_server(
        server, lambda c: c.responses.with_raw_response.retrieve(called.id), wanted=other
    )
    assert retrieved.id == called.id and retrieved.output[0].arguments == call.arguments
    with pytest.raises(openai.NotFoundError):
        _openai(server).responses.retrieve(replayed.id)


def test_responses_follow_a_json_schema_and_can_be_deleted(server: ServerProcess) -> None:
    client = _openai(server)
    response = client.responses.create(
        model=MODEL,
        input="Name a city.",
        max_output_tokens=64,
        text={"format": {"type": "json_schema", "name": "city", "schema": WEATHER_SCHEMA}},
        **GREEDY,
    )
    jsonschema.validate(json.loads(response.output_text), WEATHER_SCHEMA)
    assert response.text.format.type == "json_schema"  # type: ignore[union-attr]
    deleted = httpx.delete(
        f"{server.url}/v1/responses/{response.id}", headers={"authorization": f"Bearer {API_KEY}"}
    )
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.create(model=MODEL, input="Go on.", previous_response_id=response.id)


def test_responses_refuse_what_they_do_not_serve_in_openais_shape(server: ServerProcess) -> None:
    headers = {"authorization": f"Bearer {API_KEY}"}
    cases = [
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input.0.content.0"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": [{"type": "web_search_call"}]}, "input.0.type"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "tool_choice": "required"}, None),
    ]  # fmt: skip
    for body, param in cases:
        answer = httpx.post(f"{server.url}/v1/responses", json=body, headers=headers, timeout=30)
        assert answer.status_code == 400, (body, answer.text)
        error = answer.json()["error"]
        assert error["type"] == "BadRequestError" and error["message"]
        if param is not None:
            assert error["param"] == param, (body, error)
    # An id that is not one of ours names no file of the store.
    body = {"input": "hi", "previous_response_id": "../supervisor"}
    answer = httpx.post(f"{server.url}/v1/responses", json=body, headers=headers, timeout=30)
    assert answer.status_code == 404 and answer.json()["error"]["param"] == "previous_response_id"


def test_messages_stop_sequences_lengths_and_the_stream(server: ServerProcess) -> None:
    claude = _anthropic(server)
    conversation: list[Any] = [
        {"role": "user", "content": [{"type": "text", "text": "Count from one to ten in words."}]},
        {"role": "assistant", "content": "one, two, three,"},
        {"role": "user", "content": "Go on, from four."},
    ]
    whole = claude.messages.create(
        model=MODEL, messages=conversation, max_tokens=40, extra_body=GREEDY
    )
    text = whole.content[0].text  # type: ignore[union-attr]
    assert text
    with claude.messages.stream(
        model=MODEL, messages=conversation, max_tokens=40, extra_body=GREEDY
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == text  # type: ignore[union-attr]
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    # The SDK's helper adds a `text` and `content_block_stop` convenience event per delta and
    # block; the wire order underneath is Anthropic's.
    wire = [k for k in kinds if k not in ("text",)]
    assert wire[0] == "message_start" and wire[-2:] == ["message_delta", "message_stop"]
    assert wire[1] == "content_block_start" and wire[-3] == "content_block_stop"

    word = text.split()[1].strip(",.")
    stopped = claude.messages.create(
        model=MODEL, messages=conversation, max_tokens=40, stop_sequences=[word],
        extra_body=GREEDY,
    )  # fmt: skip
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert word not in stopped.content[0].text  # type: ignore[union-attr]
    short = claude.messages.create(
        model=MODEL, messages=conversation, max_tokens=2, extra_body=GREEDY
    )
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2


def test_messages_tool_use_and_tool_result(server: ServerProcess) -> None:
    claude = _anthropic(server)
    tools: list[Any] = [
        {
            "name": "get_weather",
            "description": "The weather in a city",
            "input_schema": WEATHER_SCHEMA,
        }
    ]
    asked: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = claude.messages.create(
        model=MODEL, messages=asked, tools=tools, max_tokens=64, extra_body=GREEDY,
        tool_choice={"type": "tool", "name": "get_weather"},
    )  # fmt: skip
    assert called.stop_reason == "tool_use"
    [use] = called.content
    assert use.type == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER_SCHEMA)
    with claude.messages.stream(
        model=MODEL, messages=asked, tools=tools, tool_choice={"type": "any"},
        max_tokens=64, extra_body=GREEDY,
    ) as stream:  # fmt: skip
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content] == ["tool_use"]
    assert streamed.content[0].input == use.input  # type: ignore[union-attr]

    answered = claude.messages.create(
        model=MODEL,
        tools=tools,
        max_tokens=24,
        extra_body=GREEDY,
        tool_choice={"type": "none"},
        messages=[
            *asked,
            {"role": "assistant",
             "content": [use.model_dump(include={"type", "id", "name", "input"})]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": "21 C and clear"},
            ]},
        ],
    )  # fmt: skip
    assert answered.content[0].type == "text" and answered.stop_reason in ("end_turn", "max_tokens")


def test_messages_errors_are_anthropics_and_the_key_is_checked(server: ServerProcess) -> None:
    claude = _anthropic(server)
    with pytest.raises(anthropic.NotFoundError, match="does not exist"):
        claude.messages.create(
            model="nope", max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )
    url = f"{server.url}/v1/messages"
    key = {"x-api-key": API_KEY}
    cases = [
        ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "data": "", "media_type": "image/png"}}
        ]}]}, "messages.0.content.0"),
        ({"max_tokens": 4, "temperature": 1.5, "messages": [{"role": "user", "content": "x"}]},
         "temperature"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
          "tools": [{"name": "f", "input_schema": {"type": "object"}}],
          "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ]  # fmt: skip
    for body, named in cases:
        answer = httpx.post(url, json=body, headers=key, timeout=30)
        assert answer.status_code == 400, (body, answer.text)
        error = answer.json()
        assert error["type"] == "error", error
        assert error["error"]["type"] == "invalid_request_error"
        assert named in error["error"]["message"], (named, error)
    refused = httpx.post(f"{url}/count_tokens", json={"messages": []}, headers=key, timeout=30)
    assert refused.status_code == 400 and refused.json()["type"] == "error"
