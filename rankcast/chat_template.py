"""A model's chat template rendered as transformers renders it, without importing transformers.

Checkpoints ship their chat template as Jinja written against transformers' environment, so a
prompt is only the one the model was trained on if that environment is reproduced: a sandbox
that cannot mutate its inputs, `trim_blocks` and `lstrip_blocks`, loop controls, a `tojson`
that does not escape HTML, `raise_exception` and `strftime_now`, a `namespace` that refuses
underscore names, and the `{% generation %}` block (which only marks assistant text for
training masks, so here it renders its body). The template sees the conversation (messages
with None-valued keys dropped and the reasoning fields aliased as transformers aliases them),
`tools`, `documents`, `add_generation_prompt`, the named special tokens (`bos_token`, ...) and
the caller's own variables (a request's `chat_template_kwargs`, such as Qwen3's `enable_thinking`),
which may override a special token's name but not the conversation's own arguments.

transformers is kept out of the serving path because importing it costs over a second of a
2-core machine's start-up (its lazy-module machinery indexes the whole package); the tests hold
this renderer to transformers' output on the embedded model and on templates that use each
feature above.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# A message's reasoning can arrive under any of these names; templates read the first, and
# gpt-oss templates read "thinking".
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        block = nodes.CallBlock(self.call_method("_body"), [], [], body)
        block.set_lineno(lineno)
        return block

    def _body(self, caller: Any) -> str:
        return str(caller())


class _Namespace(jinja2.utils.Namespace):
    """Jinja's `namespace()` without underscore-prefixed names, which would reach interpreter
    internals through attribute access."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template cannot store the underscore name {name!r} on a namespace"
            )


class _DictMaker:
    """`dict(...)` and `dict.fromkeys(...)` inside a template, and nothing else of the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The template compiled once per source text (a server renders it for every chat)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictMaker()
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def pick_template(templates: str | Mapping[str, str], with_tools: bool) -> str:
    """The template to render: a checkpoint with several named ones uses "tool_use" when the
    request has tools and the model has one, else "default"."""
    if isinstance(templates, str):
        return templates
    if with_tools and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    raise ValueError(
        f"this model has several chat templates ({', '.join(sorted(templates))}) and none "
        "is named 'default'"
    )


def _template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as templates expect it: keys whose value is None dropped (OpenAI clients send
    `content: null` beside tool calls, which templates would print as "None"), and the
    reasoning copied under every name templates read it by."""
    if not isinstance(message, Mapping):
        raise ValueError(f"a chat message must be an object, not {type(message).__name__}")
    kept = {key: value for key, value in message.items() if value is not None}
    reasoning = next((kept[key] for key in _REASONING_FIELDS if key in kept), None)
    if reasoning is not None:
        kept = {"thinking": reasoning, **kept, "reasoning_content": reasoning}
    return kept


# What `render_chat` passes itself: variables of a caller cannot take these names.
RESERVED_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    special_tokens: Mapping[str, str],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    variables: Mapping[str, Any] | None = None,
) -> str:
    """The prompt text of a conversation. `variables` are more names the template sees, as
    transformers' `apply_chat_template(**kwargs)` passes them (ValueError for a reserved
    name). A template's own refusal (`raise_exception`) and Jinja's errors come out as
    jinja2.TemplateError."""
    if not messages:
        raise ValueError("the conversation is empty")
    reserved = [name for name in variables or {} if name in RESERVED_VARIABLES]
    if reserved:
        raise ValueError(
            f"chat template variables cannot be named {', '.join(map(repr, reserved))}: "
            "the conversation sets those"
        )
    return compile_template(template).render(
        **{**special_tokens, **(variables or {})},
        messages=[_template_message(m) for m in messages],
        tools=tools,
        documents=None,
        add_generation_prompt=add_generation_prompt,
    )
