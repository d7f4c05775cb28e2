"""The Rust API server's chat output parsers (`rust/frontend/src/output_parsers.rs`, run by the
`parse_replay` binary) against the Python ones (`rankcast/api_server/output_parsers.py`): the
same outputs, cut into the same deltas, must give the same reasoning, content and calls at
every step, not only in total, since a fleet answers a stream from either server. Tool-call
arguments are compared as text: the Rust side writes them as `json.dumps` does (key order,
repeated keys, big integers, float spelling, NaN, escapes), which is what the client sees."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
from typing import Any

from rankcast.api_server.output_parsers import HermesToolParser, OutputParser, ThinkParser
from tests.entrypoints.test_output_parsers import CASES
from tests.rust_build import binary

Step = list[Any]  # [reasoning, content, [[name, arguments], ...]]

# Call bodies that take the JSON reader and writer through what Python's json module does.
BODIES = [
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    '\n{ "name" : "f" , "arguments" : { } }\n',
    '{"arguments": {"z": {"y": [{}], "x": []}}, "name": "g"}',
    '{"name": "f", "arguments": {"b": 1, "a": 2, "b": 3}}',
    '{"name": "f", "arguments": {"n": [1.50, 1E2, -0, -0.0, 1e-7, 0.0001, 1e16, 1e15, 2.5e-300,'
    " 1e400, 123456789012345678901234567890, true, false, null]}}",
    '{"name": "f", "arguments": {"v": NaN, "w": -Infinity, "x": Infinity}}',
    '{"name": "f", "arguments": {"s": "\\u00e9\\ud83d\\ude00 \\n\\t\\"\\\\\\/ \\u0001 é ✓"}}',
    '{"name": "f"}',
    '{"name": "", "arguments": {}}',
    '{"name": 1}',
    '{"name": "f", "arguments": []}',
    '{"name": "f", "arguments": NaN}',
    "[1]",
    '{"name": "f", "arguments": {',
    '{"name": "f", "arguments": {"s": "\\x"}}',
    '{"name": "f", "arguments": {"s": "a\tb"}}',
    '{"name": "f", "arguments": {}} extra',
    '{"name": "f", "arguments": {"a": 01}}',
    '{"name": "f", "arguments": {"a": 1.}}',
    '{"name": "f", "arguments": {"a": [1,]}}',
]

# What outputs are made of: the tags and pieces of them, the whitespace the parsers strip
# (Python's `str.isspace` set included), text in and out of ASCII.
PARTS = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<thi",
    "</th",
    "<tool_",
    "</tool_ca",
    "\n",
    "\n\n",
    " ",
    "\t",
    "\x1c",
    "\u2028",
    "\u3000",
    "Paris",
    "é",
    "✓ ok",
    "<",
    "think>",
    *BODIES,
]


def _python(case: dict[str, Any]) -> list[Step]:
    tools = case["tools"]
    think = ThinkParser(case["opened"], case["constrained"], call_ends=tools)
    parser = OutputParser(think if case["think"] else None, HermesToolParser() if tools else None)
    steps = [parser.feed(piece) for piece in case["pieces"]]
    steps.append(parser.finish())
    return [
        [reasoning, parsed.content, [[c.name, c.arguments] for c in parsed.calls]]
        for reasoning, parsed in steps
    ]


def _rust(cases: list[dict[str, Any]]) -> list[list[Step]]:
    """Every case through `parse_replay` in one run."""
    run = subprocess.run(
        [str(binary("parse_replay"))],
        input="".join(json.dumps(case) + "\n" for case in cases),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    # Lines end at "\n" only: str.splitlines would also cut at the U+2028 the JSON holds.
    return [json.loads(line) for line in run.stdout.split("\n")[:-1]]


def _cut(text: str, cuts: list[int]) -> list[str]:
    return [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]


def _case(text: str, cuts: list[int], flags: tuple[bool, bool, bool, bool]) -> dict[str, Any]:
    opened, constrained, tools, think = flags
    return {
        "opened": opened,
        "constrained": constrained,
        "tools": tools,
        "think": think,
        "pieces": _cut(text, cuts),
    }


def _compare(cases: list[dict[str, Any]]) -> None:
    rust = _rust(cases)
    assert len(rust) == len(cases)
    for case, got in zip(cases, rust, strict=True):
        assert got == _python(case), case


def test_the_python_cases_give_the_same_steps_cut_anywhere() -> None:
    """Each case of the Python parsers' own tests, whole, cut once at every place, and a
    character a piece, with each parser on and off."""
    cases = []
    for (text, opened, constrained, tools), _ in CASES:
        cut_sets = [[], list(range(1, len(text)))] + [[i] for i in range(len(text) + 1)]
        for cuts in cut_sets:
            cases.append(_case(text, cuts, (opened, constrained, tools, True)))
        cases.append(_case(text, [], (opened, constrained, tools, False)))
    _compare(cases)


def test_generated_outputs_give_the_same_steps() -> None:
    """Outputs put together from tags, pieces of tags, whitespace, text and call bodies (valid
    and not), under every flag, cut at random places (seeded, so a failure repeats)."""
    rng = random.Random(20240611)
    cases = []
    for _ in range(3000):
        text = "".join(rng.choice(PARTS) for _ in range(rng.randint(1, 8)))
        flags = (rng.random() < 0.5, rng.random() < 0.3, rng.random() < 0.7, rng.random() < 0.8)
        places = range(1, len(text))
        cuts = sorted(rng.sample(places, min(len(places), rng.randint(0, 12))))
        cases.append(_case(text, cuts, flags))
    _compare(cases)


def test_each_call_body_gives_the_same_arguments_text() -> None:
    """Every body as the one call of an output: the arguments string must be Python's
    `json.dumps` of what the model wrote, byte for byte (or no call, the same on both)."""
    cases = [
        _case(f"<tool_call>{body}</tool_call>", [], (False, False, True, False)) for body in BODIES
    ]
    _compare(cases)
    called = [_python(case)[0][2] for case in cases]
    assert sum(bool(calls) for calls in called) >= 7, "the bodies should hold valid calls too"
