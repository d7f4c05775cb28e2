"""What a chat's output text holds beside its answer: the model's reasoning, and the tool
calls it writes itself (vLLM's `--reasoning-parser` and `--tool-call-parser`).

Both parsers read text as it streams, a delta at a time, and hold back only what the next
delta could still change (the start of a tag, the newlines before `</think>`, a tool call
until it is complete); a whole answer is the same parser fed once. So a stream's pieces put
together are exactly what the same answer gives unstreamed, however the text was cut.

- `ThinkParser` (`qwen3`): the text between `<think>` and `</think>` is reasoning, the rest
  content, with the newlines Qwen3's template puts around each stripped as the template strips
  them when it renders the conversation back. The model opens `<think>` at the start of its
  output, or the chat template has already opened it at the end of the prompt (Qwen3
  thinking-2507, Qwen3.5; `enable_thinking` decides in some templates) and only `</think>`
  comes. An output with no `</think>` is all reasoning when `<think>` was opened (cut by
  max_tokens while thinking), else all content: a template that closed the block
  (`enable_thinking: false` writes `<think>\\n\\n</think>` into the prompt) means no reasoning.
- `HermesToolParser` (`hermes`): each `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  in the content is a tool call (the whitespace around the tags goes with them); one whose
  JSON is not such an object stays content, tags and all, as does anything outside the tags.
  A call is passed on only once complete, so a stream never shows a call's JSON as text.
  With both, calls are read in what follows the reasoning, and a `<tool_call>` written inside
  `<think>` ends the reasoning (Qwen3.5 may call without closing the block; vLLM reads it so).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

THINK_START, THINK_END = "<think>", "</think>"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper prefix of `tag`: what could
    still become the tag when more text comes."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def prompt_opens_think(prompt: str) -> bool:
    """Whether the chat template left `<think>` open at the end of the prompt, so the output
    starts inside the reasoning."""
    return prompt.rstrip().endswith(THINK_START)


_State = Literal["lead", "reasoning", "tentative", "after_end", "content"]


@dataclass
class Split:
    """What a stretch of output turned into."""

    reasoning: str = ""
    content: str = ""


class ThinkParser:
    """Qwen3's `<think>` block, read incrementally (`feed` each delta, then `finish`).

    `opened`: the prompt left `<think>` open. `constrained`: the request's output follows a
    grammar from its first token, so with `opened` it is reasoning only if the grammar put a
    `</think>` in it (a JSON schema's output is content): held until `</think>` or the end.
    `call_ends`: a `<tool_call>` also ends the reasoning (tool calls are parsed after it)."""

    def __init__(self, opened: bool, constrained: bool = False, call_ends: bool = False) -> None:
        self.call_ends = call_ends
        self.state: _State = "lead"
        if opened:
            self.state = "tentative" if constrained else "reasoning"
        self.held = ""
        self.reasoning_started = False  # reasoning text given out yet (its leading "\n" go)
        # The template opened the block, and a model may still write `<think>` first.
        self.repeated_start = opened

    def feed(self, text: str) -> Split:
        if self.state == "content":  # the common case once the reasoning is over
            return Split(content=text)
        self.held += text
        return self._advance(final=False)

    def finish(self) -> Split:
        return self._advance(final=True)

    def _reasoning(self, text: str) -> str:
        if not self.reasoning_started:
            text = text.lstrip("\n")
            self.reasoning_started = bool(text)
        return text

    def _advance(self, final: bool) -> Split:
        out = Split()
        while True:
            held = self.held
            if self.state == "lead":
                # The model may open the block: `<think>` first, after any whitespace.
                rest = held.lstrip()
                if rest.startswith(THINK_START):
                    self.state, self.held = "reasoning", rest[len(THINK_START) :]
                    continue
                if not final and THINK_START.startswith(rest):
                    return out  # nothing yet, or the start of a `<think>`
                self.state, self.held = "content", ""
                out.content += held
                return out
            if self.state == "tentative":
                end = held.find(THINK_END)
                if end < 0:
                    if final:  # the grammar wrote no `</think>`: its output is the answer
                        self.state, self.held = "content", ""
                        out.content += held
                    return out
                self.state, self.repeated_start = "reasoning", False
                rest = held.lstrip()
                if rest.startswith(THINK_START):
                    self.held = rest[len(THINK_START) :]
                continue
            if self.state == "reasoning":
                if self.repeated_start:
                    rest = held.lstrip()
                    if not final and THINK_START.startswith(rest) and rest != THINK_START:
                        return out  # nothing yet, or the start of a `<think>`
                    self.repeated_start = False
                    if rest.startswith(THINK_START):
                        held = self.held = rest[len(THINK_START) :]
                end = held.find(THINK_END)
                call = held.find(CALL_START) if self.call_ends else -1
                if call >= 0 and (end < 0 or call < end):
                    # A tool call ends the reasoning it was written in (as vLLM reads Qwen3.5).
                    out.reasoning += self._reasoning(held[:call].rstrip("\n"))
                    self.state, self.held = "content", ""
                    out.content += held[call:]
                    return out
                if end >= 0:
                    out.reasoning += self._reasoning(held[:end].rstrip("\n"))
                    self.state, self.held = "after_end", held[end + len(THINK_END) :]
                    continue
                if final:
                    out.reasoning += self._reasoning(held)
                    self.held = ""
                    return out
                # Keep what could still be `</think>` (or `<tool_call>`), and the newlines
                # before it.
                partial = _partial_tag(held, THINK_END)
                if self.call_ends:
                    partial = max(partial, _partial_tag(held, CALL_START))
                keep = len(held[: len(held) - partial].rstrip("\n"))
                out.reasoning += self._reasoning(held[:keep])
                self.held = held[keep:]
                return out
            if self.state == "after_end":
                rest = held.lstrip("\n")
                if rest:
                    self.state, self.held = "content", ""
                    out.content += rest
                return out
            out.content += held  # "content": only reached with text held from before
            self.held = ""
            return out


@dataclass
class ToolCall:
    name: str
    arguments: str  # the arguments object as a JSON string, as OpenAI gives them
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_message(self) -> dict[str, Any]:
        """The call in a message's `tool_calls`."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def _hermes_call(body: str) -> ToolCall | None:
    """The call a `<tool_call>` block's text holds: a JSON object with a string `name` and an
    object `arguments` (absent: no arguments); None for anything else."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    name, arguments = value.get("name"), value.get("arguments", {})
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


@dataclass
class Parsed:
    """Content and the tool calls found in it, from one `feed` or `finish`."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class HermesToolParser:
    """`<tool_call>` blocks in a chat's content, read incrementally (`feed`, then `finish`)."""

    def __init__(self) -> None:
        self.in_call = False
        self.after_call = False  # whitespace after a call's `</tool_call>` goes with it
        self.held = ""
        self.space = ""  # whitespace before a `<tool_call>`: dropped if the call is one
        self.calls = 0

    def feed(self, text: str) -> Parsed:
        self.held += text
        return self._advance(final=False)

    def finish(self) -> Parsed:
        return self._advance(final=True)

    def _advance(self, final: bool) -> Parsed:
        out = Parsed()
        while True:
            held = self.held
            if self.in_call:
                end = held.find(CALL_END)
                if end < 0 and not final:
                    return out
                body = held if end < 0 else held[:end]
                # A block the output ends inside is a call if its JSON is whole (the model
                # stopped before `</tool_call>`), text otherwise (max_tokens cut it).
                call = _hermes_call(body)
                self.in_call, self.held = False, "" if end < 0 else held[end + len(CALL_END) :]
                if call is not None:
                    out.calls.append(call)
                    self.calls += 1
                    self.after_call = True
                else:
                    closing = "" if end < 0 else CALL_END
                    out.content += self.space + CALL_START + body + closing
                self.space = ""
                if end < 0:
                    return out
                continue
            if self.after_call:
                rest = held.lstrip()
                if not rest and not final:
                    self.held = ""
                    return out
                self.after_call, held = False, rest
                self.held = held
            start = held.find(CALL_START)
            if start >= 0:
                before = held[:start]
                text = before.rstrip()
                out.content += text
                self.space = before[len(text) :]
                self.in_call, self.held = True, held[start + len(CALL_START) :]
                continue
            if final:
                out.content += held
                self.held = ""
                return out
            # Keep what could still be `<tool_call>`, and the whitespace before it.
            keep = len(held) - _partial_tag(held, CALL_START)
            keep = len(held[:keep].rstrip())
            out.content += held[:keep]
            self.held = held[keep:]
            return out


@dataclass
class ChatOutput:
    """A whole answer, parsed."""

    content: str
    reasoning: str | None  # None: no reasoning (or an empty `<think></think>`)
    calls: list[ToolCall]


class OutputParser:
    """The parsers a request's answer goes through: reasoning first, then tool calls in what
    is left (a call written inside `<think>` is reasoning, not a call)."""

    def __init__(self, think: ThinkParser | None, tools: HermesToolParser | None) -> None:
        self.think = think
        self.tools = tools

    def feed(self, text: str) -> tuple[str, Parsed]:
        """(reasoning, parsed content) for one delta of output text."""
        return self._tools(self.think.feed(text) if self.think else Split(content=text), False)

    def finish(self) -> tuple[str, Parsed]:
        return self._tools(self.think.finish() if self.think else Split(), True)

    def _tools(self, split: Split, final: bool) -> tuple[str, Parsed]:
        if self.tools is None:
            return split.reasoning, Parsed(split.content)
        parsed = self.tools.feed(split.content) if split.content else Parsed()
        if final:
            last = self.tools.finish()
            parsed.content += last.content
            parsed.calls += last.calls
        return split.reasoning, parsed

    def step(self, text: str, finished: bool) -> tuple[str, Parsed]:
        """One streamed output read: its new `text` (and, on the last, what was held back),
        as reasoning, then content and calls."""
        reasoning, parsed = self.feed(text) if text else ("", Parsed())
        if finished:
            last_reasoning, last = self.finish()
            reasoning += last_reasoning
            parsed.content += last.content
            parsed.calls += last.calls
        return reasoning, parsed

    def whole(self, text: str) -> ChatOutput:
        """A whole answer at once: the same parsers, fed once."""
        reasoning, parsed = self.feed(text)
        last_reasoning, last = self.finish()
        return ChatOutput(
            parsed.content + last.content,
            reasoning + last_reasoning or None,
            parsed.calls + last.calls,
        )
