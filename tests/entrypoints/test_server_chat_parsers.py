"""`--reasoning-parser qwen3` and `--enable-auto-tool-choice --tool-call-parser hermes` through a
real `rankcast serve`, driven by the official openai client.

The model is the tiny random-weight Llama with a Qwen3-like chat template; what it writes is
forced by a one-string `choice` (the grammar masks every other token), so each test knows the
exact output text the parsers read: the parsers are tested on real engine output, streamed a
token at a time, not on a mock.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.entrypoints.server_process import ServerProcess, tiny_model_args

# Qwen3's template in what matters here: tools described in the system turn, and the
# assistant's turn opened with `enable_thinking` false as Qwen3 closes it (an empty block);
# `thinking_opened` leaves `<think>` open at the end of the prompt, as Qwen3-thinking-2507's
# template and Qwen3.5's do.
TEMPLATE = """\
{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a function as <tool_call>{"name": <name>, "arguments": <args>}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% elif thinking_opened is defined and thinking_opened %}<think>
{% endif %}
{%- endif %}"""

MODEL = "tiny-qwen3-like"
# The parsers a Qwen3 server runs with (vLLM's flags), on every API server of the fleet.
PARSER_FLAGS = (
    "--reasoning-parser",
    "qwen3",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
)
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    model = tmp_path_factory.mktemp("tiny-qwen3-like") / "model"
    shutil.copytree(tiny_llama_dir, model)
    (model / "chat_template.jinja").write_text(TEMPLATE)
    proc = ServerProcess(
        *tiny_model_args(
            model,
            "--served-model-name",
            MODEL,
            "--max-model-len",
            "512",
            *PARSER_FLAGS,
        ),
        api_server_count=1,
    )
    with proc.running():
        yield proc


@pytest.fixture()
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def _ask(client: openai.OpenAI, output: str, stream: bool = False, **extra: Any) -> Any:
    """A chat request whose output is exactly `output`."""
    body = {"structured_outputs": {"choice": [output]}, **extra.pop("extra_body", {})}
    return client.chat.completions.create(
        model=MODEL,
        messages=extra.pop("messages", ASK),
        max_tokens=extra.pop("max_tokens", 120),
        temperature=0,
        stream=stream,
        extra_body=body,
        **extra,
    )


def _gather(stream: Any) -> dict[str, Any]:
    """A stream's deltas by kind: reasoning and content pieces, tool calls by index (as a
    client assembles them), the finish reason; each chunk carries one kind."""
    got: dict[str, Any] = {"reasoning": [], "content": [], "calls": {}, "finish": None}
    for chunk in stream:
        (choice,) = chunk.choices
        delta = choice.delta
        extra = delta.model_extra or {}
        kinds = [k for k in ("content", "tool_calls") if getattr(delta, k)]
        kinds += [k for k in ("reasoning_content",) if extra.get(k)]
        assert len(kinds) <= 1, f"a chunk with {kinds}"
        if extra.get("reasoning_content"):
            assert extra["reasoning"] == extra["reasoning_content"]
            got["reasoning"].append(extra["reasoning_content"])
        if delta.content:
            got["content"].append(delta.content)
        for call in delta.tool_calls or []:
            entry = got["calls"].setdefault(call.index, {"id": None, "name": "", "arguments": ""})
            if call.id:
                assert entry["id"] is None and not entry["arguments"], "the id comes first, once"
                entry["id"] = call.id
                assert call.type == "function"
            if call.function.name:
                entry["name"] += call.function.name
            entry["arguments"] += call.function.arguments or ""
        if choice.finish_reason is not None:
            got["finish"] = choice.finish_reason
    return got


def test_reasoning_is_taken_out_of_the_content(client: openai.OpenAI) -> None:
    output = "<think>\nThe capital of France.\n</think>\n\nParis"
    response = _ask(client, output)
    message = response.choices[0].message
    assert message.content == "Paris"
    assert message.reasoning_content == "The capital of France."
    assert message.model_extra["reasoning"] == "The capital of France."
    assert message.tool_calls is None and response.choices[0].finish_reason == "stop"
    streamed = _gather(_ask(client, output, stream=True))
    assert "".join(streamed["reasoning"]) == "The capital of France."
    assert "".join(streamed["content"]) == "Paris"
    assert len(streamed["reasoning"]) > 1, "reasoning streams as it comes, not at the end"
    assert streamed["finish"] == "stop" and streamed["calls"] == {}


def test_an_unclosed_block_is_reasoning_and_a_closed_prompt_block_is_none(
    client: openai.OpenAI,
) -> None:
    """`<think>` with no `</think>` (cut while thinking) is all reasoning; with
    `enable_thinking: false` the template closes the block, so a stray `</think>` is text."""
    for stream in (False, True):
        response = _ask(client, "<think>Still thinking", stream=stream)
        if stream:
            got = _gather(response)
            assert "".join(got["reasoning"]) == "Still thinking" and got["content"] == []
        else:
            assert response.choices[0].message.content is None
            assert response.choices[0].message.reasoning_content == "Still thinking"
    closed = _ask(
        client, "why</think>Paris", extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert closed.choices[0].message.content == "why</think>Paris"
    assert closed.choices[0].message.reasoning_content is None


def test_chat_template_kwargs_reach_the_template(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    """`enable_thinking: false` writes Qwen3's empty block into the prompt; `thinking_opened`
    leaves `<think>` open there, so the output starts inside the reasoning and only
    `</think>` comes."""

    def prompt(kwargs: dict[str, Any]) -> str:
        body = {"model": MODEL, "messages": ASK, "chat_template_kwargs": kwargs}
        ids = httpx.post(f"{server.url}/v1/chat/completions/render", json=body, timeout=30)
        assert ids.status_code == 200, ids.text
        text = httpx.post(
            f"{server.url}/detokenize", json={"tokens": ids.json()["token_ids"]}, timeout=30
        )
        # /tokenize renders the same prompt from the same fields.
        del body["model"]
        counted = httpx.post(f"{server.url}/tokenize", json=body, timeout=30).json()
        assert counted["tokens"] == ids.json()["token_ids"]
        return str(text.json()["prompt"])

    assert prompt({}).endswith("<|im_start|>assistant\n")
    assert prompt({"enable_thinking": False}).endswith("assistant\n<think>\n\n</think>\n\n")
    assert prompt({"thinking_opened": True}).endswith("assistant\n<think>\n")
    opened = {"chat_template_kwargs": {"thinking_opened": True}}
    response = _ask(client, "Why not.\n</think>\n\nParis", extra_body=opened)
    assert response.choices[0].message.reasoning_content == "Why not."
    assert response.choices[0].message.content == "Paris"
    got = _gather(_ask(client, "Why not.\n</think>\n\nParis", stream=True, extra_body=opened))
    assert ("".join(got["reasoning"]), "".join(got["content"])) == ("Why not.", "Paris")
    # Free text after an opened block, cut by max_tokens before any `</think>`: reasoning.
    free = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=4, temperature=0, extra_body=opened
    )
    assert free.choices[0].message.content is None
    assert (free.choices[0].message.model_extra or {})["reasoning_content"]
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs") as refused:
        _ask(client, "x", extra_body={"chat_template_kwargs": {"messages": []}})
    assert refused.value.param == "chat_template_kwargs"


def test_a_tool_call_the_model_writes_becomes_tool_calls(client: openai.OpenAI) -> None:
    output = (
        f"<think>Needs the weather.</think>\n\nLet me check.\n<tool_call>\n{CALL}\n</tool_call>"
    )
    response = _ask(client, output, tools=TOOLS)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert choice.message.reasoning_content == "Needs the weather."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    streamed = _gather(_ask(client, output, stream=True, tools=TOOLS))
    assert streamed["finish"] == "tool_calls"
    assert "".join(streamed["content"]) == "Let me check."
    assert not any("tool_call" in piece or "{" in piece for piece in streamed["content"])
    assert "".join(streamed["reasoning"]) == "Needs the weather."
    (entry,) = streamed["calls"].values()
    assert entry["id"].startswith("call_") and entry["name"] == "get_weather"
    assert json.loads(entry["arguments"]) == {"city": "Paris"}
    assert list(streamed["calls"]) == [0]
    # Logprobs still come for every token, text held back or not.
    chunks = list(
        _ask(
            client,
            output,
            stream=True,
            tools=TOOLS,
            logprobs=True,
            stream_options={"include_usage": True},
        )
    )
    entries = [c.choices[0].logprobs.content for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum(len(e) for e in entries) == chunks[-1].usage.completion_tokens


def test_malformed_tool_json_stays_content(client: openai.OpenAI) -> None:
    output = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    response = _ask(client, output, tools=TOOLS)
    assert response.choices[0].message.content == output
    assert response.choices[0].message.tool_calls is None
    assert response.choices[0].finish_reason == "stop"
    streamed = _gather(_ask(client, output, stream=True, tools=TOOLS))
    assert "".join(streamed["content"]) == output
    assert streamed["calls"] == {} and streamed["finish"] == "stop"


def test_calls_are_read_only_when_the_request_leaves_them_to_the_model(
    client: openai.OpenAI,
) -> None:
    """Without tools, or with tool_choice none, the same text is the answer."""
    output = f"<tool_call>{CALL}</tool_call>"
    assert _ask(client, output).choices[0].message.content == output
    none = _ask(client, output, tools=TOOLS, tool_choice="none")
    assert none.choices[0].message.content == output
    assert none.choices[0].message.tool_calls is None
