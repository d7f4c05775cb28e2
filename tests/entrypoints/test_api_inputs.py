"""No input makes an API server answer 5xx (other than the documented 503s).

Every field is bounded at validation: integers to 64 bits, numbers finite, text valid Unicode, so
each such input is a 400 naming where it is. A last resort turns anything unexpected into a JSON
500 in the OpenAI error shape whose request id the log line carries. A property-based sweep
(schemathesis, valid and invalid inputs from the server's own OpenAPI schema) of every route of
a real server checks that nothing it generates is answered with a server error.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.generation.modes import GenerationMode

from rankcast.api_server.middleware import LastResortErrors
from tests.entrypoints.server_process import ServerProcess, tiny_model_args


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        *tiny_model_args(
            tiny_llama_dir,
            "--max-model-len",
            "96",
            "--max-num-seqs",
            "8",
            "--enable-lora",
            "--allow-runtime-lora-updating",
        ),
        api_server_count=1,
    )
    with proc.running():
        yield proc


# Per operation and mode (valid, invalid): bounded, so the sweep takes well under a minute.
EXAMPLES_PER_MODE = 15

CHAT = '"messages":[{"role":"user","content":"hi"}],"max_tokens":2'

# (route, raw JSON body, what the 400's message must name): each was a 500 once, or a misleading
# message (NaN refused as "must be <= 2").
BAD_BODIES = [
    ("/v1/completions", '{"prompt":"hi","max_tokens":2,"seed":18446744073709551616}', "seed"),
    ("/v1/completions", '{"prompt":"hi","max_tokens":2,"seed":-9223372036854775809}', "seed"),
    ("/v1/completions", '{"prompt":"hi","max_tokens":2,"top_k":18446744073709551616}', "top_k"),
    ("/v1/completions", '{"prompt":"hi","max_tokens":18446744073709551616}', "max_tokens"),
    ("/v1/completions", '{"prompt":[1,2,18446744073709551616],"max_tokens":2}', "prompt[2]"),
    ("/v1/completions", '{"prompt":"a\\ud800b","max_tokens":2}', "prompt: text is not valid"),
    ("/v1/completions", '{"prompt":"hi","max_tokens":2,"stop":["\\udc00"]}', "stop[0]"),
    ("/v1/completions", '{"prompt":"hi","max_tokens":2,"x":{"\\ud800":1}}', "x key"),
    (
        "/v1/chat/completions",
        '{"messages":[{"role":"user","content":"a\\ud800b"}],"max_tokens":2}',
        "messages[0].content: text is not valid Unicode",
    ),
    (
        "/v1/chat/completions",
        '{"messages":[{"role":"user","content":[{"type":"text","text":"\\ud800"}]}]}',
        "messages[0].content[0].text",
    ),
    ("/v1/chat/completions", "{" + CHAT + ',"model":"\\ud800"}', "model"),
    ("/v1/chat/completions", "{" + CHAT + ',"temperature":NaN}', "temperature: nan is not a fin"),
    ("/v1/chat/completions", "{" + CHAT + ',"temperature":Infinity}', "temperature: inf"),
    ("/v1/chat/completions", "{" + CHAT + ',"top_p":-Infinity}', "top_p: -inf"),
    ("/collective_rpc", '{"method":"rank_info","args":["\\ud800"]}', "args[0]"),
    ("/collective_rpc", '{"method":"rank_info","timeout":Infinity}', "timeout"),
    ("/v1/load_lora_adapter", '{"lora_name":"\\ud800","lora_path":"/x"}', "lora_name"),
    ("/v1/load_lora_adapter", '{"lora_name":"x","lora_path":"/tmp/a\\u0000b"}', "lora_path: "),
    # Output shapes that cannot be built, or that contradict each other, are named.
    (
        "/v1/chat/completions",
        "{" + CHAT + ',"response_format":{"type":"json_schema","json_schema":{"name":"x",'
        '"schema":{"type":"objekt"}}}}',
        'response_format: json: Unsupported type "objekt"',
    ),
    (
        "/v1/chat/completions",
        "{" + CHAT + ',"response_format":{"type":"json_schema"}}',
        "json_schema needs json_schema.schema",
    ),
    (
        "/v1/chat/completions",
        "{" + CHAT + ',"tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":"auto"}',
        "tool_choice 'auto'",
    ),
    (
        "/v1/chat/completions",
        "{" + CHAT + ',"tools":[{"type":"function","function":{"name":"f"}}]}',
        "tool_choice 'auto' (the default when tools are given)",
    ),
    (
        "/v1/chat/completions",
        "{" + CHAT + ',"tools":[{"type":"function","function":{"name":"f"}}],'
        '"tool_choice":{"type":"function","function":{"name":"g"}}}',
        "tool_choice names 'g', which is not in tools",
    ),
    ("/v1/completions", '{"prompt":"hi","guided_regex":"a(b"}', "guided_regex: regex: "),
    ("/v1/completions", '{"prompt":"hi","guided_grammar":"start: foo"}', "unknown name 'foo'"),
    ("/v1/completions", '{"prompt":"hi","guided_json":"{not json"}', "schema is not valid JSON"),
    ("/v1/completions", '{"prompt":"hi","guided_choice":[]}', "guided_choice"),
    (
        "/v1/completions",
        '{"prompt":"hi","guided_regex":"[0-9]+","guided_choice":["a"]}',
        "give at most one output shape, got guided_regex, guided_choice",
    ),
    (
        "/v1/completions",
        '{"prompt":"hi","guided_regex":"[0-9]+","ignore_eos":true}',
        "ignore_eos cannot be combined with structured outputs",
    ),
]


@pytest.mark.parametrize("route, body, named", BAD_BODIES)
def test_unrepresentable_input_is_a_400_naming_where_it_is(
    server: ServerProcess, route: str, body: str, named: str
) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        response = http.post(route, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError"
    assert named in error["message"]


def test_plain_text_output_formats_are_served(server: ServerProcess) -> None:
    body = {"prompt": "hi", "max_tokens": 2, "response_format": {"type": "text"}}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        plain = http.post("/v1/completions", json=body)
        no_tools = http.post(
            "/v1/completions",
            json={
                "prompt": "hi",
                "max_tokens": 2,
                "tools": [{"type": "function"}],
                "tool_choice": "none",
            },
        )
    assert plain.status_code == 200, plain.text
    assert no_tools.status_code == 200, no_tools.text


def test_the_largest_values_that_fit_are_served(server: ServerProcess) -> None:
    body = {
        "prompt": "hi",
        "max_tokens": 2,
        "seed": 2**64 - 1,
        "top_k": 2**63 - 1,
        "temperature": 2.0,
    }
    with httpx.Client(base_url=server.url, timeout=60) as http:
        response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


def test_a_method_a_route_does_not_take_is_a_405_naming_those_it_does(
    server: ServerProcess,
) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        traced = http.request("TRACE", "/version")
        unknown = http.post("/collective_rpc", json={"method": "no_such_method"})
        image = http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        )
    assert traced.status_code == 405 and traced.headers["allow"] == "GET"
    assert traced.json()["error"]["code"] == 405
    # A method no extension has is a thing that does not exist, as an unknown model is.
    assert unknown.status_code == 404 and "no_such_method" in unknown.json()["error"]["message"]
    assert image.status_code == 400
    assert image.json()["error"]["param"].startswith("messages.0.content.0"), image.text


def test_the_schema_documents_the_400_that_invalid_bodies_get(server: ServerProcess) -> None:
    schema = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    with_body = [
        (path, operation)
        for path, item in schema["paths"].items()
        for operation in item.values()
        if "requestBody" in operation
    ]
    assert len(with_body) >= 5
    # Token ids are bounded by the served vocabulary, which only the running server knows.
    tokens = schema["components"]["schemas"]["DetokenizeRequest"]["properties"]["tokens"]
    assert tokens["items"]["maximum"] == 49151, tokens
    for path, operation in with_body:
        assert "422" not in operation["responses"], path
        error = operation["responses"]["400"]["content"]["application/json"]["schema"]
        fields = set(error["properties"]["error"]["properties"])
        if path.startswith("/v1/messages"):  # Anthropic's shape
            assert fields == {"message", "type"} and "type" in error["properties"]
        else:
            assert fields == {"message", "type", "param", "code"}


def _failing_app() -> FastAPI:
    app = FastAPI()
    app.add_middleware(LastResortErrors)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a bug the routes did not expect")

    return app


def test_an_unexpected_exception_is_a_json_500_whose_id_the_log_carries(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The fault is injected (no input reaches a bug once the routes validate)."""
    caplog.set_level(logging.ERROR, logger="rankcast.api_server.middleware")

    async def get() -> httpx.Response:
        transport = httpx.ASGITransport(app=_failing_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            return await http.get("/boom")

    response = asyncio.run(get())
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "InternalServerError" and error["code"] == 500
    request_id = response.headers["x-request-id"]
    assert request_id in error["message"]
    (record,) = [r for r in caplog.records if request_id in r.getMessage()]
    assert record.exc_info is not None and "a bug the routes did not expect" in str(
        record.exc_info[1]
    )


# ---- the property-based sweep of every route ----


def _in_its_apis_shape(path: str, response: httpx.Response) -> bool:
    """An error answer in the shape of the route's API: Anthropic's under /v1/messages,
    OpenAI's everywhere else."""
    try:
        body = response.json()
    except ValueError:
        return False
    if path.startswith("/v1/messages"):
        error = body.get("error") if body.get("type") == "error" else None
        return isinstance(error, dict) and {"type", "message"} <= error.keys()
    error = body.get("error")
    return isinstance(error, dict) and {"message", "type", "param", "code"} <= error.keys()


def test_no_generated_request_gets_a_server_error(server: ServerProcess) -> None:
    """Every operation of the server's own OpenAPI schema, with inputs that fit it and inputs
    that do not (schemathesis' positive and negative modes), a bounded number of each."""
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    # An event stream never ends by itself: its routes have tests of their own.
    schema = schema.exclude(path_regex="^/v1/events")
    failures: list[str] = []
    swept = []
    for result in schema.get_all_operations():
        operation = result.ok()
        swept.append(operation.label)
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=EXAMPLES_PER_MODE,
                deadline=None,
                derandomize=True,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            def sweep(case: Any) -> None:
                response = case.call(timeout=60)
                if response.status_code >= 500 or (
                    response.status_code >= 400 and not _in_its_apis_shape(case.path, response)
                ):
                    failures.append(
                        f"{case.method} {case.formatted_path} body={case.body!r} "
                        f"query={case.query!r} -> {response.status_code} {response.text[:200]}"
                    )

            try:
                sweep()
            except Unsatisfiable:
                # A route that takes no input (GET /health) has no invalid input to make.
                assert mode is GenerationMode.NEGATIVE, operation.label
    assert "POST /v1/chat/completions" in swept and "POST /v1/completions" in swept
    assert "POST /v1/responses" in swept and "POST /v1/messages" in swept
    assert not failures, "\n".join(failures[:20])
