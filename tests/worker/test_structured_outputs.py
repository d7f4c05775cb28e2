"""Structured outputs on the offline engine: the output follows its shape, the shape's end ends
the output, and a constrained request changes nothing for the others in its batch."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from rankcast import LLM
from rankcast.sampling_params import SamplingParams
from rankcast.structured_outputs import StructuredOutputs
from rankcast.tokenizer import load_hf_tokenizer
from rankcast.worker.grammar import GrammarMatchers, TokenMask

CITIES = ["Paris", "London", "Rome", "Lagos", "Lima", "Oslo", "Quito", "Hanoi"]


def person_schema(i: int) -> dict[str, Any]:
    """32 different schemas (fields, bounds and enums vary with i), each with bounded output
    so the test's max_tokens always suffices."""
    properties: dict[str, Any] = {
        "name": {"type": "string", "maxLength": 12 + i % 5},
        "age": {"type": "integer", "minimum": i, "maximum": 60 + i},
        "city": {"enum": CITIES[: 2 + i % 7]},
    }
    if i % 2:
        properties["member"] = {"type": "boolean"}
    if i % 3 == 0:
        properties["tags"] = {
            "type": "array",
            "items": {"type": "string", "maxLength": 8},
            "maxItems": 2,
        }
    return {
        "type": "object",
        "properties": properties,
        "required": sorted(properties),
        "additionalProperties": False,
    }


def chat(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[Any]:
    return llm.chat([[{"role": "user", "content": p}] for p in prompts], params)


def test_32_json_schema_requests_in_one_batch_all_validate(smollm_fp32: LLM) -> None:
    schemas = [person_schema(i) for i in range(32)]
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.9,
            seed=i,
            max_tokens=160,
            structured=StructuredOutputs(json=schemas[i]),
        )
        for i in range(32)
    ]
    prompts = [f"Describe person number {i} from a novel as JSON." for i in range(32)]
    outputs = chat(smollm_fp32, prompts, params)
    for schema, output in zip(schemas, outputs, strict=True):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema)


def test_regex_and_choice_are_matched_exactly(smollm_fp32: LLM) -> None:
    choices = ['say "yes"', "no\\n", "perhaps | never"]
    params = [
        SamplingParams(
            temperature=1.0,
            seed=7,
            max_tokens=30,
            structured=StructuredOutputs(regex=r"[0-9]{3}-[0-9]{4}"),
        ),
        SamplingParams(
            temperature=0.0, max_tokens=30, structured=StructuredOutputs(choice=choices)
        ),
        SamplingParams(
            temperature=0.0,
            max_tokens=60,
            structured=StructuredOutputs(
                grammar='start: "(" NUMBER ("," NUMBER)* ")"\nNUMBER: /[1-9][0-9]?/'
            ),
        ),
    ]
    prompts = ["What is your phone number?", "Will it rain?", "List some numbers."]
    phone, choice, numbers = (o.outputs[0] for o in chat(smollm_fp32, prompts, params))
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", phone.text), phone.text
    assert choice.text in choices
    assert re.fullmatch(r"\([1-9][0-9]?(,[1-9][0-9]?)*\)", numbers.text), numbers.text
    # The shape's end is EOS, which the engine stops on.
    assert phone.finish_reason == choice.finish_reason == "stop"


def test_constrained_requests_cost_the_others_nothing(smollm_fp32: LLM) -> None:
    """Unconstrained neighbours sample exactly what they sample alone; a constrained request's
    logprobs are the raw model's (taken before the mask): its first token's top-5 equal those
    of the same prompt unconstrained."""
    free = SamplingParams(temperature=0.0, max_tokens=24, logprobs=5)
    prompts = ["Name a colour.", "Count to five.", "Name a colour."]
    alone = chat(smollm_fp32, prompts[:2], [free, free])
    constrained = SamplingParams(
        temperature=0.0,
        max_tokens=24,
        logprobs=5,
        structured=StructuredOutputs(choice=["cerulean blue", "vermilion"]),
    )
    mixed = chat(smollm_fp32, prompts, [free, free, constrained])
    for before, after in zip(alone, mixed[:2], strict=True):
        assert after.outputs[0].token_ids == before.outputs[0].token_ids
    shaped = mixed[2].outputs[0]
    assert shaped.text in ("cerulean blue", "vermilion")
    assert shaped.logprobs is not None and alone[0].outputs[0].logprobs is not None
    raw_first = alone[0].outputs[0].logprobs[0]
    shaped_first = shaped.logprobs[0]
    top5 = {t: lp.logprob for t, lp in raw_first.items() if lp.rank <= 5}
    shaped_top5 = {t: lp.logprob for t, lp in shaped_first.items() if lp.rank <= 5}
    assert shaped_top5.keys() == top5.keys()
    for token, logprob in top5.items():
        assert shaped_top5[token] == pytest.approx(logprob, abs=1e-4)


def test_any_json_object(smollm_fp32: LLM) -> None:
    params = SamplingParams(
        temperature=0.0, max_tokens=200, structured=StructuredOutputs(json_object=True)
    )
    (output,) = chat(smollm_fp32, ["Give me a JSON object describing a cat."], [params])
    completion = output.outputs[0]
    if completion.finish_reason == "stop":
        assert isinstance(json.loads(completion.text), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert completion.text.startswith("{")


def test_pipeline_stages_mask_on_the_output_rank(tiny_llama_dir: Path) -> None:
    """PP=2 with mp ranks: only the last stage samples, so only it holds matchers; the output
    follows the shape through the real rank processes."""
    llm = LLM(
        str(tiny_llama_dir), dtype="float32", pipeline_parallel_size=2, kv_cache_space_gib=0.05
    )
    try:
        schema = person_schema(3)
        params = [
            SamplingParams(
                temperature=0.0, max_tokens=120, structured=StructuredOutputs(json=schema)
            ),
            SamplingParams(
                temperature=0.0, max_tokens=12, structured=StructuredOutputs(regex="[a-e]{12}")
            ),
        ]
        person, letters = (o.outputs[0] for o in llm.generate(["a person:", "letters:"], params))
        jsonschema.validate(json.loads(person.text), schema)
        assert re.fullmatch("[a-e]{12}", letters.text), letters.text
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "spec, problem",
    [
        ({}, "exactly one of json, json_object, regex, choice, grammar (got none)"),
        ({"regex": "a", "choice": ["a"]}, "(got regex, choice)"),
        ({"json": {"type": "objekt"}}, 'json: Unsupported type "objekt"'),
        ({"json": "[1, 2]"}, "json: the schema must be a JSON object"),
        ({"regex": "a(b"}, "regex: "),
        ({"choice": ["a", ""]}, "choice: give one or more choices"),
        ({"grammar": "start: nowhere"}, "unknown name 'nowhere'"),
    ],
)
def test_a_shape_that_cannot_be_built_is_refused_when_made(
    spec: dict[str, Any], problem: str
) -> None:
    with pytest.raises(ValueError) as refused:
        StructuredOutputs(**spec)
    assert problem in str(refused.value)


def test_structured_outputs_cannot_ignore_eos() -> None:
    with pytest.raises(ValueError, match="ignore_eos cannot be combined"):
        SamplingParams(ignore_eos=True, structured=StructuredOutputs(regex="a"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_token_mask_masks_the_constrained_rows_bit_by_bit(dtype: torch.dtype) -> None:
    """Bit t of a row (little-endian 32-bit words) keeps token t; rows not named are untouched;
    logits wider than the mask lose their extra tokens. float32 and bfloat16 take the C++
    kernel where it is built, float16 the plain-torch path: all must agree."""
    vocab, allowed = 70, [0, 5, 31, 32, 33, 63]
    values = [sum(1 << (t - 32 * w) for t in allowed if t // 32 == w) for w in range(2)]
    signed = [v - (1 << 32) if v >= 1 << 31 else v for v in values]  # as int32 holds them
    words = torch.tensor([signed], dtype=torch.int32)
    logits = torch.randn(3, vocab).to(dtype)
    before = logits.clone()
    TokenMask(rows=[1], bitmask=words).apply(logits)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    kept = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert kept == allowed
    assert torch.equal(logits[1, allowed], before[1, allowed])


@pytest.mark.parametrize(
    "structured",
    [
        StructuredOutputs(json_object=True),
        StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
    ],
)
def test_what_a_schema_leaves_open_stays_open(
    embedded_model_dir: Path, structured: StructuredOutputs
) -> None:
    """JSON Schema's meaning, not a stricter one: unnamed properties are allowed unless the
    schema says `additionalProperties: false` (any JSON object means any, not only `{}`)."""
    grammars = GrammarMatchers(embedded_model_dir, 49152, (2,))
    matcher = grammars.matcher("r", structured)
    assert matcher.accept_string('{"a": 1, "b": [true, "x"]}')
    assert matcher.is_completed()


def test_draft_rows_are_the_grammars_states_after_each_draft(embedded_model_dir: Path) -> None:
    """Speculative decoding: the row after each draft is the mask the grammar gives once it
    has taken the drafts before it; past a draft it refuses, rows allow everything; and the
    matcher is left where it was."""
    grammars = GrammarMatchers(embedded_model_dir, 49152, (2,))
    structured = StructuredOutputs(regex="(ab|ac)d")
    tokenizer = load_hf_tokenizer(embedded_model_dir)
    a, b, c, d = (tokenizer.convert_tokens_to_ids(t) for t in "abcd")
    drafted = grammars.matcher("r", structured)
    stepped = grammars.matcher("s", structured)
    mask = grammars.mask([3], [drafted], [[a, b, c]])  # c after "ab" leaves the shape
    assert mask.rows == [3, 4, 5, 6]
    one = grammars.mask([0], [stepped]).bitmask
    assert torch.equal(mask.bitmask[0], one[0])
    assert stepped.accept_token(a)
    assert torch.equal(mask.bitmask[1], grammars.mask([0], [stepped]).bitmask[0])
    assert stepped.accept_token(b)
    assert torch.equal(mask.bitmask[2], grammars.mask([0], [stepped]).bitmask[0])
    assert bool((mask.bitmask[3] == -1).all()), "after the refused draft: not read, all allowed"
    # Left where it was: it still takes the first token and refuses d.
    assert not drafted.accept_token(d) and drafted.accept_token(a)
