"""`/v1/responses` and `/v1/messages` through a mixed fleet (one Python and one Rust API server
behind one port), driven by the official `openai` and `anthropic` clients: every call is
answered by both kinds of server with the same greedy text and the same stream event
sequence, a stored response is continued (`previous_response_id`) and retrieved through the
other kind of server than the one that stored it, and bad requests get the same error bytes.

The fleet runs with an API key, so the OpenAI client's `Authorization: Bearer` and the
Anthropic client's `x-api-key` are both checked on both servers. The tiny random model calls no
tool on its own: the calls are forced through `tool_choice` (a grammar, as a real client would
force them), with argument values a schema enum leaves no choice in.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import anthropic
import httpx
import httpx2
import openai
import pytest

from tests.entrypoints.server_process import ServerProcess, tiny_model_args
from tests.frontend_rust.rust_fleet import frontend_env

KEY = "fleet-key"
MODEL = "model"  # the served name: the directory's
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Lyon"]}},
    "required": ["city"],
    "additionalProperties": False,
}
T = TypeVar("T")


@pytest.fixture(scope="module")
def fleet(
    tiny_llama_dir: Path, embedded_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """The tiny model with the chat template the Rust server renders, served by one Python and
    one Rust API server."""
    model = tmp_path_factory.mktemp("chat-model") / MODEL
    model.mkdir()
    for item in tiny_llama_dir.iterdir():
        (model / item.name).symlink_to(item)
    template = (embedded_model_dir / "chat_template.jinja").read_text()
    (model / "chat_template.jinja").write_text(template)
    server = ServerProcess(
        *tiny_model_args(model, "--api-key", KEY),
        api_server_count=1,
        rust_api_server_count=1,
        env=frontend_env(),
    )
    with server.running():
        yield server


def on_each_server(call: Callable[[Any], T], client: Any = httpx.Client) -> dict[str, T]:
    """`call` over fresh connections (the kernel spreads them over the servers sharing the
    port) until both the Python (0) and the Rust (1) API server have answered it, by server.
    `client`: the HTTP client class the SDK takes (the Anthropic SDK's is httpx2's)."""
    answers: dict[str, T] = {}
    deadline = time.monotonic() + 60
    while set(answers) != {"0", "1"}:
        assert time.monotonic() < deadline, f"only servers {sorted(answers)} answered"
        served: list[str] = []

        def seen(response: Any, served: list[str] = served) -> None:
            served.append(response.headers["x-rankcast-api-server"])

        with client(timeout=60, event_hooks={"response": [seen]}) as http:
            result = call(http)
        assert len(set(served)) == 1, served
        answers.setdefault(served[0], result)
    return answers


def the_same(answers: dict[str, T]) -> T:
    """What both servers answered, which must be one thing."""
    assert answers["0"] == answers["1"], answers
    return answers["0"]


def oai(http: httpx.Client, url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, http_client=http, max_retries=0)


def claude(http: httpx2.Client, url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=KEY, http_client=http, max_retries=0)


def test_responses_plain_streamed_and_by_the_stream_helper(fleet: ServerProcess) -> None:
    ask: dict[str, Any] = {
        "model": MODEL,
        "input": "Tell me a story",
        "instructions": "Be brief",
        "max_output_tokens": 8,
        "temperature": 0,
    }

    def whole(http: httpx.Client) -> tuple[str, str, int]:
        response = oai(http, fleet.url).responses.create(**ask)
        assert response.usage is not None
        return response.status, response.output_text, response.usage.output_tokens

    status, text, tokens = the_same(on_each_server(whole))
    assert (status, tokens) == ("incomplete", 8) and text

    def streamed(http: httpx.Client) -> tuple[list[str], str]:
        events = list(oai(http, fleet.url).responses.create(**ask, stream=True))
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        numbers = [e.sequence_number for e in events]
        assert numbers == list(range(len(events)))
        return [e.type for e in events], deltas

    types, deltas = the_same(on_each_server(streamed))
    assert deltas == text
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]

    # The SDK's stream helper wants a completed response: a JSON schema ends the answer.
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    shaped = {**ask, "max_output_tokens": 20}
    shaped["text"] = {"format": {"type": "json_schema", "name": "answer", "schema": schema}}

    def helper(http: httpx.Client) -> tuple[str, str]:
        with oai(http, fleet.url).responses.stream(**shaped) as stream:
            final = stream.get_final_response()
        return final.status or "", final.output_text

    status, answer = the_same(on_each_server(helper))
    assert status == "completed" and set(json.loads(answer)) == {"ok"}


def test_a_forced_function_call_streams_as_a_call(fleet: ServerProcess) -> None:
    ask: dict[str, Any] = {
        "model": MODEL,
        "input": "What is the weather in Paris?",
        "max_output_tokens": 40,
        "temperature": 0,
        "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}],
        "tool_choice": {"type": "function", "name": "get_weather"},
    }

    def whole(http: httpx.Client) -> list[tuple[str, str, str]]:
        response = oai(http, fleet.url).responses.create(**ask)
        return [
            (item.type, item.name, item.arguments)
            for item in response.output
            if item.type == "function_call"
        ]

    assert the_same(on_each_server(whole)) == [
        ("function_call", "get_weather", '{"city": "Paris"}')
    ]

    def streamed(http: httpx.Client) -> list[str]:
        events = list(oai(http, fleet.url).responses.create(**ask, stream=True))
        (delta,) = [e for e in events if e.type == "response.function_call_arguments.delta"]
        assert delta.delta == '{"city": "Paris"}'
        return [e.type for e in events]

    assert "response.output_text.delta" not in the_same(on_each_server(streamed))


def test_a_conversation_moves_between_the_kinds_of_server(fleet: ServerProcess) -> None:
    """A response stored by either kind is continued by both (with a forced call and its
    output in between, the items vLLM's users saw lost) and retrieved by both."""
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    first: dict[str, Any] = {
        "model": MODEL,
        "input": "Tell me the weather",
        "max_output_tokens": 80,
        "temperature": 0,
        "tools": tools,
        "tool_choice": "required",
    }

    def create(http: httpx.Client) -> Any:
        return oai(http, fleet.url).responses.create(**first)

    started = on_each_server(create)
    calls = {s: [i for i in r.output if i.type == "function_call"] for s, r in started.items()}
    assert [(c.name, c.arguments) for c in calls["0"]] == [
        (c.name, c.arguments) for c in calls["1"]
    ]
    assert calls["0"], started["0"].output
    for kind, response in started.items():
        outputs = [
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
            for call in calls[kind]
        ]

        def follow(
            http: httpx.Client, previous: str = response.id, outputs: list[Any] = outputs
        ) -> tuple[str, int, str]:
            later = oai(http, fleet.url).responses.create(
                model=MODEL,
                input=outputs,
                previous_response_id=previous,
                instructions="Be brief",
                max_output_tokens=6,
                temperature=0,
            )
            assert later.usage is not None
            return later.output_text, later.usage.input_tokens, later.id

        continued = on_each_server(follow)
        texts = {s: (text, tokens) for s, (text, tokens, _) in continued.items()}
        text, tokens = the_same(texts)
        # The stored conversation is what the model is given again: the same request with
        # every item written out gives the same prompt and text.
        spelled = [
            {"role": "user", "content": first["input"]},
            *[
                {"type": "function_call", "call_id": c.call_id, "name": c.name,
                 "arguments": c.arguments}
                for c in calls[kind]
            ],
            *outputs,
        ]  # fmt: skip
        with httpx.Client(timeout=60) as http:
            whole = oai(http, fleet.url).responses.create(
                model=MODEL,
                input=spelled,  # type: ignore[arg-type]
                instructions="Be brief",
                max_output_tokens=6,
                temperature=0,
                store=False,
            )
        assert whole.usage is not None
        assert (whole.output_text, whole.usage.input_tokens) == (text, tokens)
        # Each continuation, whoever stored it, reads the same from both kinds of server.
        for _, _, stored_id in continued.values():

            def fetch(http: httpx.Client, stored_id: str = stored_id) -> str:
                found = http.get(
                    f"{fleet.url}/v1/responses/{stored_id}",
                    headers={"Authorization": f"Bearer {KEY}"},
                )
                assert found.status_code == 200, found.text
                return found.text

            body = json.loads(the_same(on_each_server(fetch)))
            assert body["previous_response_id"] == response.id
            assert body["output"][0]["content"][0]["text"] == text

    # The SDK's own retrieve, of a response stored by the other kind of server.
    for kind, response in started.items():

        def retrieve(http: httpx.Client, stored_id: str = response.id) -> str:
            return oai(http, fleet.url).responses.retrieve(stored_id).model_dump_json()

        assert the_same(on_each_server(retrieve)) == response.model_dump_json(), kind


def test_messages_create_stream_and_count_tokens(fleet: ServerProcess) -> None:
    ask: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 8,
        "system": "Be brief",
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "extra_body": {"temperature": 0},
    }

    def whole(http: httpx2.Client) -> tuple[str, str | None, int, int]:
        message = claude(http, fleet.url).messages.create(**ask)
        (block,) = message.content
        assert block.type == "text"
        usage = message.usage
        return block.text, message.stop_reason, usage.input_tokens, usage.output_tokens

    text, stop_reason, prompt_tokens, tokens = the_same(on_each_server(whole, httpx2.Client))
    assert (stop_reason, tokens) == ("max_tokens", 8)

    def streamed(http: httpx2.Client) -> tuple[str, list[str], str | None]:
        types: list[str] = []
        with claude(http, fleet.url).messages.stream(**ask) as stream:
            for event in stream:
                types.append(event.type)
            final = stream.get_final_message()
        (block,) = final.content
        assert block.type == "text"
        return block.text, types, final.stop_reason

    streamed_text, types, streamed_stop = the_same(on_each_server(streamed, httpx2.Client))
    assert (streamed_text, streamed_stop) == (text, "max_tokens")
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]

    def count(http: httpx2.Client) -> int:
        counted = claude(http, fleet.url).messages.count_tokens(
            model=MODEL, system=ask["system"], messages=ask["messages"]
        )
        return counted.input_tokens

    assert the_same(on_each_server(count, httpx2.Client)) == prompt_tokens


def test_messages_tools_with_tool_choice_any(fleet: ServerProcess) -> None:
    ask: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 80,
        "messages": [{"role": "user", "content": "Tell me the weather"}],
        "tools": [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER}],
        "tool_choice": {"type": "any"},
        "extra_body": {"temperature": 0},
    }

    def whole(http: httpx2.Client) -> tuple[str | None, list[tuple[str, object]]]:
        message = claude(http, fleet.url).messages.create(**ask)
        uses = [(b.name, b.input) for b in message.content if b.type == "tool_use"]
        return message.stop_reason, uses

    calls = the_same(on_each_server(whole, httpx2.Client))
    assert calls == ("tool_use", [("get_weather", {"city": "Paris"})])

    def streamed(http: httpx2.Client) -> tuple[list[str], list[object]]:
        with claude(http, fleet.url).messages.stream(**ask) as stream:
            types = [event.type for event in stream]
            final = stream.get_final_message()
        return types, [b.input for b in final.content if b.type == "tool_use"]

    types, inputs = the_same(on_each_server(streamed, httpx2.Client))
    assert inputs == [{"city": "Paris"}] and "input_json" in types


def _raw(fleet: ServerProcess, method: str, path: str, **request: Any) -> Callable[..., Any]:
    def call(http: httpx.Client) -> tuple[int, str]:
        response = http.request(method, f"{fleet.url}{path}", **request)
        return response.status_code, response.text

    return call


def test_bad_requests_get_the_same_error_bytes(fleet: ServerProcess) -> None:
    bearer = {"Authorization": f"Bearer {KEY}"}
    anthropic_key = {"x-api-key": KEY}
    unknown = "resp_" + "0" * 32
    cases = [
        ("POST", "/v1/responses", {"json": {"input": 5, "temperature": 3}, "headers": bearer}),
        (
            "POST",
            "/v1/responses",
            {"json": {"input": "x", "previous_response_id": unknown}, "headers": bearer},
        ),
        ("GET", f"/v1/responses/{unknown}", {"headers": bearer}),
        ("DELETE", "/v1/responses/nope", {"headers": bearer}),
        (
            "POST",
            "/v1/responses",
            {"json": {"input": [{"role": "robot", "content": "x"}]}, "headers": bearer},
        ),
        # A schema whose grammar cannot be built: the Rust server hears it from the engine.
        (
            "POST",
            "/v1/responses",
            {
                "json": {
                    "input": "x",
                    "text": {"format": {"type": "json_schema", "schema": {"type": "foo"}}},
                },
                "headers": bearer,
            },
        ),
        ("POST", "/v1/messages", {"json": {"messages": []}, "headers": anthropic_key}),
        (
            "POST",
            "/v1/messages",
            {
                "json": {
                    "max_tokens": 5,
                    "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
                },
                "headers": anthropic_key,
            },
        ),
        (
            "POST",
            "/v1/messages",
            {
                "json": {
                    "model": "nope",
                    "max_tokens": 5,
                    "messages": [{"role": "user", "content": "x"}],
                },
                "headers": anthropic_key,
            },
        ),
        ("POST", "/v1/messages", {"json": {}, "headers": {"x-api-key": "wrong"}}),
        ("POST", "/v1/responses", {"json": {}, "headers": {"x-api-key": "wrong"}}),
    ]
    for method, path, request in cases:
        status, body = the_same(on_each_server(_raw(fleet, method, path, **request)))
        assert status >= 400, (path, request, body)
        shape = json.loads(body)
        if path.startswith("/v1/messages"):
            assert shape["type"] == "error" and shape["error"]["message"], body
        else:
            assert set(shape["error"]) == {"message", "type", "param", "code"}, body
