"""What shape a request's output must take: a JSON schema, any JSON object, a regex, one of a
list of strings, or a Lark grammar.

The request carries the shape as plain data (a msgspec struct inside `SamplingParams`); the
output rank turns it into a token mask every step (`worker/grammar.py`). Masks come from
llguidance, chosen over xgrammar by measurement (`bench/structured.py` prints both): its
matcher needs no compile step per request (~0.7 ms to start one against ~3.8 ms to compile a
schema) and it has no dependencies, where xgrammar's package metadata pulls a 286 MB GPU
compiler (triton) that a CPU never uses; xgrammar's mask is faster per token (~3.5 us against
~13 us here), which at a 32-request batch is ~0.4 ms of a ~80 ms step either way.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:  # a type of llguidance's stubs only
    from llguidance._lib import JsonCompileOptions

# JSON as models write it (Python's `json.dumps` separators), with no free whitespace: a small
# model allowed any amount of whitespace can spend its whole budget on newlines.
JSON_STYLE: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class StructuredOutputs(msgspec.Struct, omit_defaults=True, kw_only=True, frozen=True):
    """Exactly one of: `json` (a JSON schema, as an object or its text), `json_object` (any
    JSON object), `regex`, `choice` (the output is one of these strings exactly) or `grammar`
    (Lark syntax, as llguidance reads it).

    Checked when made (a bad schema, regex or grammar is a `ValueError` naming the problem),
    so a request that reaches the engine always has a grammar the output rank can build.
    """

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in self._KINDS if _is_set(getattr(self, name))]
        if len(given) != 1:
            named = ", ".join(given) if given else "none"
            raise ValueError(
                f"structured outputs need exactly one of {', '.join(self._KINDS)} (got {named})"
            )
        if self.choice is not None and (not self.choice or not all(self.choice)):
            raise ValueError("choice: give one or more choices, each a non-empty string")
        from llguidance import LLMatcher

        problem = str(LLMatcher.validate_grammar(self.llguidance_grammar())).strip()
        if problem:
            raise ValueError(f"{given[0]}: {problem}")

    _KINDS = ("json", "json_object", "regex", "choice", "grammar")

    @property
    def kind(self) -> str:
        """Which of the five shapes this is (for messages and metrics)."""
        return next(name for name in self._KINDS if _is_set(getattr(self, name)))

    def llguidance_grammar(self) -> str:
        """The grammar llguidance's matcher takes, built from whichever shape is set; a schema
        given as text that is not a JSON object is a `ValueError`."""
        from llguidance import LLMatcher

        if self.json is not None:
            schema: Any = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"json: the schema is not valid JSON ({exc})") from None
            if not isinstance(schema, dict):
                raise ValueError("json: the schema must be a JSON object")
            return str(LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE))
        if self.json_object:
            return str(LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_STYLE))
        if self.regex is not None:
            return str(LLMatcher.grammar_from_regex(self.regex))
        if self.choice is not None:
            # Lark string literals read JSON's escapes, so each choice is matched exactly.
            options = " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
            return str(LLMatcher.grammar_from_lark(f"start: {options}"))
        assert self.grammar is not None
        return str(LLMatcher.grammar_from_lark(self.grammar))


def _is_set(value: Any) -> bool:
    return value is not None and value is not False
