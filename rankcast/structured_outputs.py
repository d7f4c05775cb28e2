"""What shape a request's output must take: a JSON schema, any JSON object, a regex, one of a
list of strings, or a Lark grammar.

The request carries the shape as plain data (a msgspec struct inside `SamplingParams`); the
output rank turns it into a token mask every step (`worker/grammar.py`). Masks come from
xgrammar, chosen over llguidance by measured per-token cost on CPU (`bench/structured.py`
prints both; SmolLM2's 49,152-token vocabulary, a nested schema with bounded strings, AMD EPYC
Zen 5): 4.3 us per token against 69 us, p99 14 us against 418 us. At a 32-request batch that is
~0.14 ms of a ~37 ms float32 step against ~3.5 ms (the engine bench measured llguidance's batch
at 0.91x of an unconstrained one). xgrammar compiles a schema before its first mask (~5 ms, once
per distinct schema: the compiler caches) where llguidance starts in ~0.7 ms; a request pays that
once, the mask every token.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    import xgrammar

# JSON as models write it (Python's `json.dumps` separators), with no free whitespace: a small
# model allowed any amount of whitespace can spend its whole budget on newlines.
JSON_SEPARATORS = (", ", ": ")

# xgrammar's errors start with a log prefix ("[12:00:00] /project/cpp/x.cc:12: ") and may carry
# an assertion's text; the user needs what follows.
_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: .*? is false: )?")


class StructuredOutputs(msgspec.Struct, omit_defaults=True, kw_only=True, frozen=True):
    """Exactly one of: `json` (a JSON schema, as an object or its text), `json_object` (any
    JSON object), `regex`, `choice` (the output is one of these strings exactly) or `grammar`
    (Lark syntax, as xgrammar reads it).

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
        try:
            self.xgrammar_grammar()
        except (RuntimeError, ValueError, TypeError) as exc:
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"{given[0]}: {_LOG_PREFIX.sub('', message)}") from None

    _KINDS = ("json", "json_object", "regex", "choice", "grammar")

    @property
    def kind(self) -> str:
        """Which of the five shapes this is (for messages and metrics)."""
        return next(name for name in self._KINDS if _is_set(getattr(self, name)))

    def xgrammar_grammar(self) -> xgrammar.Grammar:
        """The grammar xgrammar compiles, built from whichever shape is set; one it cannot
        build raises (`RuntimeError` from xgrammar, `ValueError` for a schema that is not a
        JSON object)."""
        from xgrammar import Grammar

        if self.json is not None or self.json_object:
            # strict_mode off: what a schema leaves open (extra properties, items of any type)
            # stays open, as JSON Schema says; xgrammar's strict mode would close it.
            return Grammar.from_json_schema(
                self._schema(), any_whitespace=False, separators=JSON_SEPARATORS, strict_mode=False
            )
        if self.regex is not None:
            return Grammar.from_regex(self.regex)
        if self.choice is not None:
            # Lark string literals read JSON's escapes, so each choice is matched exactly.
            options = " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
            return Grammar.from_lark(f"start: {options}")
        assert self.grammar is not None
        return Grammar.from_lark(self.grammar)

    def _schema(self) -> dict[str, Any]:
        if self.json is None:
            return {"type": "object"}  # json_object: any object
        schema: Any = self.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the schema is not valid JSON ({exc})") from None
        if not isinstance(schema, dict):
            raise ValueError("the schema must be a JSON object")
        return schema


def _is_set(value: Any) -> bool:
    return value is not None and value is not False
