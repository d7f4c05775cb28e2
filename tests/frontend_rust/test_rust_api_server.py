"""The Rust API server (`rust/frontend`) as an OpenAI client sees it, in front of a real engine
core: the same greedy text as the engine gives the Python client, streamed and whole, stop
strings, usage, 400s in OpenAI's shape naming the field, and 503 once the engine core is gone."""

from __future__ import annotations

import contextlib
import multiprocessing
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from rankcast.addresses import EngineAddresses
from rankcast.tokenizer import apply_chat_template, load_tokenizer
from tests.engine.engine_process import engine_core_process, python_greedy
from tests.entrypoints.server_process import free_port, wait_until_healthy
from tests.rust_build import binary

MODEL = "tiny-llama"


@dataclass
class Fleet:
    engine: multiprocessing.process.BaseProcess
    addresses: EngineAddresses
    frontend: subprocess.Popen[str]
    url: str
    model_dir: Path


@pytest.fixture(scope="module")
def model_dir(
    tiny_llama_dir: Path, embedded_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The tiny model with SmolLM2's chat template beside it (links to the rest)."""
    directory = tmp_path_factory.mktemp("model")
    for item in tiny_llama_dir.iterdir():
        (directory / item.name).symlink_to(item)
    template = (embedded_model_dir / "chat_template.jinja").read_text()
    (directory / "chat_template.jinja").write_text(template)
    return directory


@contextlib.contextmanager
def _running_fleet(model_dir: Path) -> Iterator[Fleet]:
    """An engine core with two client slots: 0 for the Python client, 1 for the Rust server."""
    with engine_core_process(model_dir, num_blocks=128) as (engine, addresses):
        port = free_port()
        client = addresses.clients[1]
        frontend = subprocess.Popen(
            [
                binary("rankcast-frontend"),
                "--model-dir", str(model_dir),
                "--served-model-name", MODEL,
                "--port", str(port),
                "--engine-input", client.input,
                "--engine-output", client.output,
                "--client-index", "1",
            ],
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            wait_until_healthy(url, frontend, timeout_s=60)
            yield Fleet(engine, addresses, frontend, url, model_dir)
        finally:
            frontend.kill()
            frontend.communicate(timeout=10)


@pytest.fixture(scope="module")
def fleet(model_dir: Path) -> Iterator[Fleet]:
    """One fleet for the tests that only send requests (each start is ~5 s of the suite)."""
    with _running_fleet(model_dir) as fleet:
        yield fleet


@pytest.fixture()
def own_fleet(model_dir: Path) -> Iterator[Fleet]:
    """A fleet of its own, for a test that kills a part of it."""
    with _running_fleet(model_dir) as fleet:
        yield fleet


def _python_greedy(fleet: Fleet, prompt_ids: list[int], max_tokens: int) -> str:
    """What the engine generates for the same prompt through the Python client, as text."""
    tokens = python_greedy(fleet.addresses, 0, prompt_ids, max_tokens)
    text: str = load_tokenizer(fleet.model_dir).decode(tokens, skip_special_tokens=True)
    return text


def _client(fleet: Fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="none", max_retries=0)


def test_completions_whole_and_streamed_equal_the_engines_greedy_text(fleet: Fleet) -> None:
    tokenizer = load_tokenizer(fleet.model_dir)
    prompt = "The capital of France is"
    expected = _python_greedy(fleet, tokenizer.encode(prompt, add_special_tokens=False), 12)
    client = _client(fleet)
    whole = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert whole.choices[0].text == expected
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    pieces = []
    usage = None
    for chunk in client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    ):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == expected
    assert usage is not None and usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_renders_the_template_as_python_does(fleet: Fleet) -> None:
    tokenizer = load_tokenizer(fleet.model_dir)
    messages = [{"role": "user", "content": "Name a colour."}]
    prompt_ids = apply_chat_template(tokenizer, messages)  # what the Python API server sends
    expected = _python_greedy(fleet, prompt_ids, 10)
    client = _client(fleet)
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert reply.choices[0].message.content == expected
    assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt_ids)
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,  # type: ignore[arg-type]
            extra_body={"ignore_eos": True},
        )
        if chunk.choices
    )
    assert streamed == expected


def test_a_stop_string_ends_the_text_before_it(fleet: Fleet) -> None:
    client = _client(fleet)
    free = client.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=16, temperature=0,
        extra_body={"ignore_eos": True},
    ).choices[0].text  # fmt: skip
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    assert stop.strip(), f"the greedy text is too short to cut: {free!r}"
    cut = client.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=16, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    ).choices[0]  # fmt: skip
    assert cut.text == free[: free.index(stop)]
    assert cut.finish_reason == "stop"


def test_bad_fields_are_400s_and_unknown_models_404s(fleet: Fleet) -> None:
    client = _client(fleet)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="hi", temperature=3)
    assert "temperature" in str(caught.value)
    with pytest.raises(openai.NotFoundError) as missing:  # as the Python servers answer
        client.completions.create(model="nope", prompt="hi")
    assert "nope" in str(missing.value)
    response = httpx.post(f"{fleet.url}/v1/completions", content=b"{not json", timeout=10)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "BadRequestError"
    models = httpx.get(f"{fleet.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL]


@pytest.mark.parametrize(
    "field",
    [
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        {"guided_regex": "[a-z]+"},
        {"structured_outputs": {"regex": "[a-z]+"}},
        {"guided_grammar": 'root ::= "a"'},
        {"response_format": {"type": "json_object"}},
        {"chat_template_kwargs": {"enable_thinking": False}},
    ],
    ids=lambda field: next(iter(field)),
)
def test_what_it_does_not_serve_yet_is_refused_by_name_not_ignored(
    fleet: Fleet, field: dict[str, object]
) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, **field}
    response = httpx.post(f"{fleet.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    (name,) = field
    assert response.json()["error"]["param"] == name
    assert f"{name} is not served" in response.json()["error"]["message"]


def test_a_dead_engine_core_makes_the_rust_server_answer_503_then_exit(own_fleet: Fleet) -> None:
    """503 at once, then exit 1 (half a second later), so that the launcher starts it again
    against the engine core's next incarnation."""
    fleet = own_fleet
    fleet.engine.kill()
    fleet.engine.join(10)
    deadline = time.monotonic() + 10
    while httpx.get(f"{fleet.url}/health", timeout=5).status_code != 503:
        assert time.monotonic() < deadline, "the Rust server did not notice the dead engine"
        time.sleep(0.02)
    assert fleet.frontend.wait(10) == 1
    assert "the engine core is gone" in fleet.frontend.communicate()[1]


TOOLS = [{"type": "function", "function": {"name": "get_weather"}}]


def test_a_choice_is_served_and_tools_are_checked_as_on_the_python_servers(fleet: Fleet) -> None:
    """A choice of strings is a grammar the engine takes as it is, so it is served (on both
    routes); tools are a chat's, and without a tool-call parser (this server was started with
    none) `tool_choice` auto is refused as the Python servers refuse it, `none` served;
    forced calls are not served yet; a template variable may not take the conversation's
    names. Each refusal names its field."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20}

    def post(route: str, body: dict[str, object]) -> httpx.Response:
        return httpx.post(f"{fleet.url}{route}", json=body, timeout=60)

    completion = post(
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "max_tokens": 20, "guided_choice": ["yes", "no way"]},
    )
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["text"] in ("yes", "no way")
    forced = post("/v1/chat/completions", {**chat, "structured_outputs": {"choice": ["Paris"]}})
    assert forced.json()["choices"][0]["message"]["content"] == "Paris"
    assert forced.json()["choices"][0]["finish_reason"] == "stop"
    # Tools with tool_choice none, and template variables, leave SmolLM2's prompt as it is.
    plain = post("/v1/chat/completions", {**chat, "temperature": 0, "ignore_eos": True})
    with_tools = post(
        "/v1/chat/completions",
        {
            **chat,
            "temperature": 0,
            "ignore_eos": True,
            "tools": TOOLS,
            "tool_choice": "none",
            "chat_template_kwargs": {"enable_thinking": False},
        },
    )
    assert with_tools.status_code == 200, with_tools.text
    assert with_tools.json()["choices"][0] == plain.json()["choices"][0]
    assert with_tools.json()["usage"] == plain.json()["usage"]
    for body, param, words in [
        ({"tools": TOOLS}, "tool_choice", "--enable-auto-tool-choice --tool-call-parser"),
        ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice", "not served"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "name"),
        ({"tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "'messages'"),
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs", "an object"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "one or more choices"),
        ({"structured_outputs": {"choices": ["a"]}}, "structured_outputs", "unknown field"),
        (
            {"guided_choice": ["a"], "structured_outputs": {"choice": ["b"]}},
            "structured_outputs",
            "at most one output shape",
        ),
        ({"guided_choice": ["a"], "ignore_eos": True}, None, "ignore_eos cannot be combined"),
    ]:
        refused = post("/v1/chat/completions", {**chat, **body})
        assert refused.status_code == 400, (body, refused.text)
        error = refused.json()["error"]
        assert error["param"] == param and words in error["message"], (body, error)
