"""Does a request's answer depend on what else runs? The batch-invariance check, per matmul path.

The standard workload's 32 chats are generated greedily in one batch, then `--alone` of them one
at a time, in the same `LLM` with prefix caching off, and the greedy texts compared: a path that
sums every output in one order whatever the batch gives 0 differing chats (docs/cpu-paths.md).
Each path runs in a fresh process (`RANKCAST_LINEAR_KERNEL`, and for the matmul build
`RANKCAST_KERNELS_ISA`): by default `auto`, `onednn` where oneDNN packs the dtype, and on an AMX
CPU the AVX512-BF16 build (`auto@avx512-bf16`), so the count is shown beside what giving the rule
up would cost or buy (the batch's tokens/s is printed with it); `--paths` names others (`rows`).
Prints a table, writes JSON, records the CPU.

There is no anchor row: vLLM-cpu and llama.cpp do not promise this (vLLM has an opt-in
batch-invariant mode on GPUs only), so "alone vs batch" for them would measure their kernels,
not a claim; bench/offline_throughput.py has their speed.

    python bench/same_answer.py [--paths auto,onednn] [--alone 12] [--tokens 64]
        [--dtype bfloat16] [--out FILE]
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

from bench.workload import ROOT, describe, load_chats, machine_info


def check(dtype: str, alone: int, tokens: int) -> dict[str, Any]:
    """In this process: the chats in one batch, then `alone` of them one at a time."""
    import torch

    from rankcast import LLM, SamplingParams
    from rankcast.model.linear_kernels import choose_linear_path

    chats, _ = load_chats()
    llm = LLM(dtype=dtype, enable_prefix_caching=False, kv_cache_space_gib=2.0, max_num_seqs=32)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=tokens)
        start = time.perf_counter()
        batch = llm.chat(chats, params)
        seconds = time.perf_counter() - start
        generated = sum(len(out.outputs[0].token_ids) for out in batch)
        differing = []
        for i in range(alone):
            single = llm.chat([chats[i]], params)[0]
            if single.outputs[0].text != batch[i].outputs[0].text:
                differing.append(i)
        setting = os.environ.get("RANKCAST_LINEAR_KERNEL", "auto")
        chosen = choose_linear_path(getattr(torch, dtype), torch.device("cpu"), setting)
        return {
            "linear_path": chosen.describe(),
            "differing": differing,
            "alone": alone,
            "batch_tok_s": generated / seconds,
        }
    finally:
        llm.shutdown()


def run_path(path: str, args: argparse.Namespace) -> dict[str, Any]:
    """One path in a fresh process: a `kernel` or `kernel@isa` (a narrowed kernel build)."""
    kernel, _, isa = path.partition("@")
    env = {**os.environ, "RANKCAST_LINEAR_KERNEL": kernel}
    if isa:
        env["RANKCAST_KERNELS_ISA"] = isa
        build = subprocess.run(
            [sys.executable, "-m", "rankcast.kernels.build"],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        if build.returncode != 0:
            return {"path": path, "error": (build.stdout + build.stderr).strip().splitlines()[-1:]}
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        f"--dtype={args.dtype}",
        f"--alone={args.alone}",
        f"--tokens={args.tokens}",
    ]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        return {"path": path, "error": done.stderr.strip().splitlines()[-1:]}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return {"path": path, **result}


def default_paths(dtype: str) -> list[str]:
    """`auto`, oneDNN where it packs the dtype, and on an AMX CPU the dot-product build too."""
    from rankcast import kernels
    from rankcast.model.linear_kernels import onednn_packs_bf16

    paths = ["auto"]
    if dtype == "float32" or onednn_packs_bf16():
        paths.append("onednn")
    if "amx_bf16" in kernels.cpu_fingerprint().split():
        paths.append("auto@avx512-bf16")
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--paths", default="", help="comma list: auto, onednn, rows, kernel@isa")
    parser.add_argument("--alone", type=int, default=12, help="chats also run one at a time")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens a chat")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "same_answer.json"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(check(args.dtype, args.alone, args.tokens)))
        return
    machine = machine_info()
    paths = [p for p in args.paths.split(",") if p] or default_paths(args.dtype)
    rows = [run_path(path, args) for path in paths]
    print(f"\n{describe(machine)}")
    print(
        f"{args.dtype}, 32 standard chats x {args.tokens} greedy tokens in one batch, then "
        f"{args.alone} alone; prefix caching off\n"
    )
    print(f"{'path':<22} {'differ':>8} {'batch tok/s':>12}  linear path")
    for row in rows:
        if "error" in row:
            print(f"{row['path']:<22} {'error':>8} {'':>12}  {' '.join(row['error'])}")
            continue
        differ = f"{len(row['differing'])}/{row['alone']}"
        print(f"{row['path']:<22} {differ:>8} {row['batch_tok_s']:>12.1f}  {row['linear_path']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "args": vars(args), "rows": rows}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
