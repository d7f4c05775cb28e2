"""What each weight type costs in quality: perplexity on a fixed text, and greedy agreement with
bfloat16 over the standard workload.

Perplexity is computed as llama.cpp's `llama-perplexity` computes it, so the two are comparable:
the text (bench/text/perplexity.txt, the embedded SmolLM2-135M-Instruct's tokenizer) cut into
windows of --ctx tokens, each window evaluated from scratch, and only the second half of each
window scored (every scored token has at least ctx/2 tokens of context). rankcast runs every
window side by side, its first half as one prompt and the rest one token per step, so it also
exercises the decode path a served model takes. Where llama.cpp is installed (LLAMA_CPP_DIR,
default ~/.cache/rankcast-llamacpp; see bench/llamacpp.py) its `llama-perplexity` runs on the
same text for each GGUF weight type it has.

The KV cache's formats (`--kv-cache-dtypes auto,int8,fp8_e4m3,fp8_e5m2`) are scored the same
way, each a row of the weight types asked for (`--weight-types bfloat16` keeps one), beside
llama.cpp with its KV cache in Q8_0 (`-fa on -ctk q8_0 -ctv q8_0`). Their cost shows at long
context: `--text long` scores the Python documentation every interpreter ships
(`pydoc_data.topics`, ~110k tokens) instead of the short text, in windows of `--ctx` up to
SmolLM2's 8,192.

Greedy agreement: the 32 standard chats, 128 tokens each with EOS ignored, generated with bf16
weights and with each other type; reported as the chats whose text is identical and the mean
number of tokens before the first difference.

    python bench/perplexity.py [--ctx 256] [--no-llamacpp] [--no-agreement] [--text long]
        [--weight-types bfloat16,...] [--kv-cache-dtypes auto,int8,fp8_e4m3,fp8_e5m2]
        [--max-windows N] [--llamacpp-types BF16,...]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import llamacpp
from bench.workload import ROOT, describe, load_chats, machine_info

TEXT = ROOT / "bench" / "text" / "perplexity.txt"
RESULTS = ROOT / "bench" / "results" / "perplexity.json"
# (name, dtype, quantization): the weight types rankcast serves.
WEIGHT_TYPES = [
    ("float32", "float32", "none"),
    ("bfloat16", "bfloat16", "none"),
    ("int8 (float32 model)", "float32", "int8"),
    ("int8 (bfloat16 model)", "bfloat16", "int8"),
    ("w8a8 (bfloat16 model)", "bfloat16", "w8a8"),
    ("q4_1 (float32 model)", "float32", "q4_1"),
    ("q4_1 (bfloat16 model)", "bfloat16", "q4_1"),
    ("q8_0 (float32 model)", "float32", "q8_0"),
    ("q8_0 (bfloat16 model)", "bfloat16", "q8_0"),
]


def long_text() -> str:
    """The Python documentation's topics as the interpreter ships them (pydoc_data): prose and
    grammar, ~465 kB, the same wherever this runs, and nothing to download or commit."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def _detokenize(model: str | None, tokens: list[int]) -> str:
    """The text of `tokens` (to give llama-perplexity the same stretch rankcast scores)."""
    from rankcast.model_files.source import resolve_model
    from rankcast.tokenizer import load_tokenizer

    return str(load_tokenizer(resolve_model(model).model_dir).decode(tokens))


def text_tokens(model: str | None = None, text: str | None = None) -> list[int]:
    from rankcast.model_files.source import resolve_model
    from rankcast.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(model).model_dir)
    return list(tokenizer.encode(text or TEXT.read_text(), add_special_tokens=False))


def rankcast_perplexity(
    tokens: list[int],
    ctx: int,
    dtype: str,
    quantization: str,
    model: str | None = None,
    kv_cache_dtype: str = "auto",
) -> dict[str, float]:
    """Perplexity over the second half of every ctx-token window, all windows in one batch, the
    KV cache holding `kv_cache_dtype` (model/kv_quant.py)."""
    from rankcast.model import kv_quant
    from rankcast.model.loader import load_model
    from rankcast.model_files.arch import ArchConfig
    from rankcast.model_files.source import resolve_model
    from rankcast.protocol import ScheduledSequence, SchedulerOutput
    from rankcast.worker.model_runner import ModelRunner

    source = resolve_model(model)
    model_dir, quantization = source.model_dir, source.quantization(quantization)
    arch = ArchConfig.from_model_dir(model_dir)
    torch_dtype = getattr(torch, dtype)
    cpu = torch.device("cpu")
    decoder = load_model(model_dir, arch, torch_dtype, cpu, quantization=quantization)
    block_size = 16
    windows = [tokens[i * ctx : (i + 1) * ctx] for i in range(len(tokens) // ctx)]
    blocks_each = -(-ctx // block_size)
    cache = kv_quant.cache_dtype(kv_cache_dtype, torch_dtype)
    runner = ModelRunner(decoder, arch, block_size, cpu, torch_dtype, None, cache)
    runner.initialize_cache(blocks_each * len(windows))
    tables = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(len(windows))]
    first = ctx // 2
    nll, count = 0.0, 0
    start = time.perf_counter()
    # Step 0: each window's first half and one more token as a prompt (logits at `first`); then
    # one token per step: the logits at position j score token j + 1, as llama-perplexity does.
    steps = [
        ScheduledSequence(f"w{i}", w[: first + 1], 0, tables[i]) for i, w in enumerate(windows)
    ]
    for position in range(first, ctx - 1):
        logits = runner.compute_logits(SchedulerOutput(steps))
        assert logits is not None
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        for i, window in enumerate(windows):
            nll -= float(logprobs[i, window[position + 1]])
        count += len(windows)
        steps = [
            ScheduledSequence(f"w{i}", [w[position + 1]], position + 1, tables[i])
            for i, w in enumerate(windows)
        ]
    return {
        "perplexity": math.exp(nll / count),
        "scored_tokens": count,
        "seconds": time.perf_counter() - start,
    }


def llamacpp_perplexity(
    weight_type: str, ctx: int, text: Path = TEXT, kv_q8_0: bool = False
) -> float | None:
    """llama-perplexity's final estimate for the anchor's file of `weight_type` (found, and run
    with `--no-repack` where it must be, by bench/llamacpp.py), or None if it has none; with
    `kv_q8_0`, its KV cache in Q8_0 (which its flash attention needs)."""
    tool, model = llamacpp.binary("llama-perplexity"), llamacpp.models().get(weight_type)
    if tool is None or model is None:
        return None
    command = [str(tool), "-m", str(model), "-f", str(text), "-c", str(ctx), "-b", str(ctx)]
    if kv_q8_0:
        command += ["-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0"]
    command += ["-t", str(llamacpp.threads())]
    if llamacpp.no_repack(weight_type):
        command.append("--no-repack")
    out = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if found is None:
        print(f"  llama-perplexity {weight_type}: no estimate (exit {out.returncode})")
        return None
    return float(found.group(1))


def greedy_outputs(dtype: str, quantization: str, model: str | None) -> list[list[int]]:
    from rankcast import LLM, SamplingParams

    chats, tokens = load_chats()
    llm = LLM(model, dtype=dtype, quantization=quantization, kv_cache_space_gib=1.0)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    outs = llm.chat(chats, params)
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    """Chats with identical tokens, and the mean count of tokens before the first difference."""
    same, prefix = 0, 0
    for a, b in zip(reference, other, strict=True):
        same += a == b
        prefix += next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
    return {
        "identical_chats": same,
        "chats": len(reference),
        "mean_common_prefix": prefix / len(reference),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ctx", type=int, default=256, help="window length in tokens")
    parser.add_argument("--no-llamacpp", action="store_true", help="skip llama-perplexity")
    parser.add_argument("--no-agreement", action="store_true", help="skip greedy agreement")
    parser.add_argument(
        "--model", default=None, help="GGUF file or HF directory (unset: the embedded SmolLM2)"
    )
    parser.add_argument(
        "--text", choices=("short", "long"), default="short", help="long: pydoc_data's topics"
    )
    parser.add_argument(
        "--weight-types", default="", help="comma list of WEIGHT_TYPES names (unset: all)"
    )
    parser.add_argument(
        "--kv-cache-dtypes", default="auto", help="comma list of --kv-cache-dtype values"
    )
    parser.add_argument(
        "--max-windows", type=int, default=0, help="score at most this many windows (0: all)"
    )
    parser.add_argument(
        "--llamacpp-types", default="", help="comma list of llama.cpp weight types (unset: all)"
    )
    args = parser.parse_args()
    machine = machine_info()
    print(describe(machine))
    text_file = TEXT
    if args.text == "long":
        text_file = RESULTS.parent / "perplexity-long.txt"
        text_file.parent.mkdir(parents=True, exist_ok=True)
        text_file.write_text(long_text())  # llama-perplexity reads a file
    tokens = text_tokens(args.model, text_file.read_text())
    if args.max_windows:  # the text's first windows only (llama.cpp reads the same file)
        tokens = tokens[: args.max_windows * args.ctx]
        text_file = text_file.with_name(text_file.stem + f"-{args.max_windows}x{args.ctx}.txt")
        text_file.write_text(_detokenize(args.model, tokens))
    print(f"text: {text_file.relative_to(ROOT)}, {len(tokens)} tokens, windows of {args.ctx}")
    results: dict[str, Any] = {
        "machine": machine,
        "ctx": args.ctx,
        "text": args.text,
        "text_tokens": len(tokens),
    }
    wanted = {w for w in args.weight_types.split(",") if w}
    unknown = wanted - {name for name, _, _ in WEIGHT_TYPES}
    if unknown:
        parser.error(f"unknown --weight-types {sorted(unknown)}")
    weight_types = [w for w in WEIGHT_TYPES if not wanted or w[0] in wanted]
    kv_dtypes = [k for k in args.kv_cache_dtypes.split(",") if k]
    ours = {}
    for name, dtype, quantization in weight_types:
        for kv in kv_dtypes:
            row = name if kv == "auto" else f"{name}, KV {kv}"
            ours[row] = rankcast_perplexity(tokens, args.ctx, dtype, quantization, args.model, kv)
            print(f"  {row}: {ours[row]['perplexity']:.4f}", flush=True)
    # The K-quant mixes llama.cpp's anchor derives from the same weights (bench/llamacpp.py),
    # served by rankcast as `auto` takes them.
    mixes = {} if args.no_llamacpp or args.model or wanted else llamacpp.models()
    for mix in (m for m in llamacpp.DERIVED if m in mixes):
        for dtype in ("float32", "bfloat16"):
            name = f"{mix} file, none / auto ({dtype} model)"
            exact = rankcast_perplexity(tokens, args.ctx, dtype, "none", str(mixes[mix]))
            ours[name] = rankcast_perplexity(tokens, args.ctx, dtype, "auto", str(mixes[mix]))
            ours[name]["perplexity_float_weights"] = exact["perplexity"]
    results["rankcast"] = ours
    theirs: dict[str, float | None] = {}
    # llama.cpp's files are the embedded model's; another model has no llama.cpp rows here.
    missing = llamacpp.missing_message("llama-perplexity")
    if args.no_llamacpp or args.model or missing:
        why = missing or "its files are the embedded model's, not --model's"
        print(f"llama.cpp: {'--no-llamacpp' if args.no_llamacpp else why}; its rows are left out")
    else:
        chosen = {t for t in args.llamacpp_types.split(",") if t}
        for t in (t for t in llamacpp.models() if not chosen or t in chosen):
            theirs[t] = llamacpp_perplexity(t, args.ctx, text_file)
            if any(kv != "auto" for kv in kv_dtypes):
                theirs[f"{t}, KV q8_0"] = llamacpp_perplexity(t, args.ctx, text_file, kv_q8_0=True)
    results["llamacpp"] = theirs
    base_name = "bfloat16" if "bfloat16" in ours else next(iter(ours))
    base = ours[base_name]["perplexity"]
    print(f"\n| weights | perplexity | vs {base_name} | scored tokens |\n|---|---|---|---|")
    for name, row in ours.items():
        change = 100 * (row["perplexity"] / base - 1)
        ppl, scored = row["perplexity"], row["scored_tokens"]
        if "perplexity_float_weights" in row:  # a file's float conversion, then `auto`
            floats = row["perplexity_float_weights"]
            change = 100 * (floats / base - 1)
            shown = f"{floats:.3f} / {ppl:.3f} | {change:+.2f} / {100 * (ppl / base - 1):+.2f} %"
            print(f"| rankcast {name} | {shown} | {scored} |")
            continue
        print(f"| rankcast {name} | {ppl:.3f} | {change:+.2f} % | {scored} |")
    for name, value in theirs.items():
        if value is not None:
            print(f"| llama.cpp {name} | {value:.3f} | {100 * (value / base - 1):+.2f} % | |")
    if not args.no_agreement:
        reference = greedy_outputs("bfloat16", "none", args.model)
        results["agreement"] = {}
        print("\n| weights | chats identical to bfloat16 | mean tokens before a difference |")
        print("|---|---|---|")
        for name, dtype, quantization in weight_types:
            if (dtype, quantization) == ("bfloat16", "none"):
                continue
            row = agreement(reference, greedy_outputs(dtype, quantization, args.model))
            results["agreement"][name] = row
            print(
                f"| {name} | {row['identical_chats']} / {row['chats']} | "
                f"{row['mean_common_prefix']:.1f} of {len(reference[0])} |"
            )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
