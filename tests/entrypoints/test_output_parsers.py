"""The reasoning and tool-call parsers on their own (api_server/output_parsers.py): what each
output text becomes, the same however a stream cuts it, and the flags that turn them on."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from rankcast.addresses import ClientAddresses
from rankcast.api_server.output_parsers import (
    HermesToolParser,
    OutputParser,
    ThinkParser,
    prompt_opens_think,
)
from rankcast.api_server.schema import _TEMPLATE_OWN
from rankcast.api_server.server_config import ApiServerConfig
from rankcast.chat_template import RESERVED_VARIABLES, render_chat
from rankcast.config import ConfigError, ServeConfig
from rankcast.launcher import cli
from rankcast.launcher.rust_api_server import frontend_command

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
BROKEN = '{"name": "get_weather", "arguments": {"city": '
WEATHER = ("get_weather", '{"city": "Paris"}')

# (output text, the prompt opened <think>, the output is constrained, tools parsed)
# -> (content, reasoning, calls as (name, arguments)).
CASES = [
    # The model opens the block; Qwen3's newlines around it go, as its template strips them.
    (("<think>why</think>Paris", False, False, False), ("Paris", "why", [])),
    (("<think>\nwhy\n\n</think>\n\nParis\n", False, False, False), ("Paris\n", "why", [])),
    (("\n<think>a\nb</think>", False, False, False), ("", "a\nb", [])),
    # The template opened it: only </think> comes (a repeated <think> is dropped).
    (("why</think>Paris", True, False, False), ("Paris", "why", [])),
    (("<think>why</think>Paris", True, False, False), ("Paris", "why", [])),
    # No </think>: reasoning if the block was opened (cut while thinking), else content.
    (("<think>why", False, False, False), ("", "why", [])),
    (("why", True, False, False), ("", "why", [])),
    (("why</think>Paris", False, False, False), ("why</think>Paris", None, [])),
    (("Paris <think>x</think>", False, False, False), ("Paris <think>x</think>", None, [])),
    (("<thinking>", False, False, False), ("<thinking>", None, [])),
    (("<think></think>Paris", False, False, False), ("Paris", None, [])),
    # A grammar's output with the block opened by the template: reasoning only up to a
    # </think> the grammar wrote, else the whole output is the answer.
    (('{"a": 1}', True, True, False), ('{"a": 1}', None, [])),
    (('why</think>{"a": 1}', True, True, False), ('{"a": 1}', "why", [])),
    # Tool calls: the whitespace around the tags goes with them; text outside stays.
    ((f"<tool_call>{CALL}</tool_call>", False, False, True), ("", None, [WEATHER])),
    (
        (f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>\nDone.", False, False, True),
        ("Let me check.Done.", None, [WEATHER]),
    ),
    (
        (
            f'<tool_call>{CALL}</tool_call>\n<tool_call>{{"name": "t"}}</tool_call>',
            False,
            False,
            True,
        ),
        ("", None, [WEATHER, ("t", "{}")]),
    ),
    # Malformed JSON, or JSON of another shape, stays content with its tags and whitespace.
    (
        (f"a \n<tool_call>{BROKEN}</tool_call> b", False, False, True),
        (f"a \n<tool_call>{BROKEN}</tool_call> b", None, []),
    ),
    (
        ('<tool_call>{"name": 1}</tool_call><tool_call>[1]</tool_call>', False, False, True),
        ('<tool_call>{"name": 1}</tool_call><tool_call>[1]</tool_call>', None, []),
    ),
    (
        ('<tool_call>{"name": "f", "arguments": "x"}</tool_call>', False, False, True),
        ('<tool_call>{"name": "f", "arguments": "x"}</tool_call>', None, []),
    ),
    # A block the output ends in: a call if its JSON is whole, text if max_tokens cut it.
    ((f"ok <tool_call>{CALL}", False, False, True), ("ok", None, [WEATHER])),
    ((f"ok <tool_call>{BROKEN}", False, False, True), (f"ok <tool_call>{BROKEN}", None, [])),
    (("ok <tool_cal", False, False, True), ("ok <tool_cal", None, [])),
    # Both: calls are read after the reasoning; a call inside <think> ends it (Qwen3.5).
    (
        (f"<think>\nweather?\n</think>\n\n<tool_call>\n{CALL}\n</tool_call>", False, False, True),
        ("", "weather?", [WEATHER]),
    ),
    ((f"weather?\n<tool_call>{CALL}</tool_call>", True, False, True), ("", "weather?", [WEATHER])),
    # Without the tool parser, tags are text.
    (
        (f"<tool_call>{CALL}</tool_call>", False, False, False),
        (f"<tool_call>{CALL}</tool_call>", None, []),
    ),
]


def _case_id(given: tuple[str, bool, bool, bool]) -> str:
    text, opened, constrained, tools = given
    flags = [
        name for name, on in (("opened", opened), ("grammar", constrained), ("tools", tools)) if on
    ]
    return "-".join([repr(text[:28]), *flags])


CASE_IDS = [_case_id(given) for given, _ in CASES]


def _parser(opened: bool, constrained: bool, tools: bool, think: bool = True) -> OutputParser:
    return OutputParser(
        ThinkParser(opened, constrained, call_ends=tools) if think else None,
        HermesToolParser() if tools else None,
    )


def _streamed(
    text: str, cuts: list[int], opened: bool, constrained: bool, tools: bool
) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """The reasoning and content pieces and the calls a stream cut at `cuts` gives."""
    parser = _parser(opened, constrained, tools)
    reasoning, content, calls = [], [], []
    for start, end in itertools.pairwise([0, *cuts, len(text)]):
        piece_reasoning, parsed = parser.feed(text[start:end])
        reasoning.append(piece_reasoning)
        content.append(parsed.content)
        calls += [(c.name, c.arguments) for c in parsed.calls]
    last_reasoning, last = parser.finish()
    reasoning.append(last_reasoning)
    content.append(last.content)
    calls += [(c.name, c.arguments) for c in last.calls]
    return reasoning, content, calls


@pytest.mark.parametrize("given, expected", CASES, ids=CASE_IDS)
def test_each_output_becomes_content_reasoning_and_calls(
    given: tuple[str, bool, bool, bool], expected: tuple[str, str | None, list[tuple[str, str]]]
) -> None:
    text, opened, constrained, tools = given
    whole = _parser(opened, constrained, tools).whole(text)
    assert (whole.content, whole.reasoning, [(c.name, c.arguments) for c in whole.calls]) == (
        expected
    )
    for call in whole.calls:
        assert call.as_message()["type"] == "function"
        assert call.id.startswith("call_") and len(call.id) == 29
        json.loads(call.arguments)


@pytest.mark.parametrize("given, expected", CASES, ids=CASE_IDS)
def test_a_stream_gives_the_same_however_it_is_cut(
    given: tuple[str, bool, bool, bool], expected: tuple[str, str | None, list[tuple[str, str]]]
) -> None:
    """Every cut into two or three pieces, and random cuts into many (down to a character a
    piece); a valid call's JSON or tags never appear in a content piece."""
    text, opened, constrained, tools = given
    content, reasoning, calls = expected
    rng = random.Random(0)
    cut_sets: list[list[int]] = [
        list(c) for n in (1, 2) for c in itertools.combinations(range(len(text) + 1), n)
    ]
    cut_sets += [
        sorted(rng.sample(range(len(text) + 1), rng.randint(3, len(text) + 1))) for _ in range(50)
    ]
    cut_sets.append(list(range(1, len(text))))
    for cuts in cut_sets:
        got_reasoning, got_content, got_calls = _streamed(text, cuts, opened, constrained, tools)
        assert "".join(got_content) == content, cuts
        assert ("".join(got_reasoning) or None) == reasoning, cuts
        assert got_calls == calls, cuts
        if calls:
            assert not any(
                "<tool_call>" in piece or "get_weather" in piece for piece in got_content
            )


def test_plain_content_streams_at_once() -> None:
    """Once the output is plain content, each delta comes straight back: nothing held."""
    parser = _parser(False, False, tools=False)
    assert parser.feed("Par")[1].content == "Par"
    assert parser.feed("is <thi")[1].content == "is <thi"
    tools = _parser(False, False, tools=True)
    assert tools.feed("Hi <tool")[1].content == "Hi"  # the start of a tag, and its space, wait
    assert tools.feed("kit")[1].content == " <toolkit"


def test_the_template_opened_think_when_the_prompt_ends_inside_it() -> None:
    assert prompt_opens_think("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_think("<|im_start|>assistant\n")


def test_chat_template_variables_reach_the_template_but_not_its_own_names() -> None:
    template = "{{ messages[0].content }}{% if enable_thinking is false %} no-think{% endif %}"
    said = [{"role": "user", "content": "hi"}]
    assert render_chat(template, said, {}) == "hi"
    assert render_chat(template, said, {}, variables={"enable_thinking": False}) == "hi no-think"
    assert (
        render_chat("{{ bos_token }}", said, {"bos_token": "<s>"}, variables={"bos_token": "B"})
        == "B"
    )
    with pytest.raises(ValueError, match="cannot be named 'messages'"):
        render_chat(template, said, {}, variables={"messages": []})
    assert _TEMPLATE_OWN == RESERVED_VARIABLES  # the request's check is the renderer's


def _serve(*argv: str) -> ServeConfig:
    args = cli.build_parser().parse_args(["serve", *argv])
    return ServeConfig(**cli.options_from_args(args, "serve"))


def test_the_flags_land_in_the_serve_config() -> None:
    config = _serve(
        "--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"
    )
    assert (config.reasoning_parser, config.enable_auto_tool_choice, config.tool_call_parser) == (
        "qwen3",
        True,
        "hermes",
    )
    with pytest.raises(SystemExit):
        _serve("--reasoning-parser", "deepseek_v9")


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--enable-auto-tool-choice",), "--enable-auto-tool-choice needs --tool-call-parser"),
        (("--tool-call-parser", "hermes"), "--tool-call-parser is read only with"),
    ],
)
def test_settings_the_servers_cannot_honour_are_refused(
    argv: tuple[str, ...], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        _serve(*argv)


def test_rust_api_servers_parse_too_and_are_told_to() -> None:
    """The Rust API server reads outputs with the same parsers (rust/frontend's
    output_parsers.rs), so a fleet with Rust servers takes the flags, and the launcher passes
    them on: a request must be answered alike whichever server it reaches."""
    config = _serve(
        "--reasoning-parser",
        "qwen3",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--api-server-count",
        "0",
        "--rust-api-server-count",
        "1",
    )
    assert config.rust_api_server_count == 1 and config.reasoning_parser == "qwen3"
    server = ApiServerConfig(
        "127.0.0.1", 8000, "m", Path("/m"), "", reasoning_parser="qwen3", tool_call_parser="hermes"
    )
    engine = ClientAddresses("ipc:///in", "ipc:///out")
    command = frontend_command(Path("/bin/rankcast-frontend"), server, 0, engine)
    for flag, value in (("--reasoning-parser", "qwen3"), ("--tool-call-parser", "hermes")):
        assert command[command.index(flag) + 1] == value
    plain = frontend_command(
        Path("/bin/rankcast-frontend"),
        ApiServerConfig("127.0.0.1", 8000, "m", Path("/m"), ""),
        0,
        engine,
    )
    assert "--reasoning-parser" not in plain and "--tool-call-parser" not in plain
