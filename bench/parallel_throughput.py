"""Offline throughput of SmolLM2-135M on the standard workload across parallel layouts.

TP=1, TP=3, PP=2 run one `LLM` each (the mp executor for several ranks); DP=2 runs two
independent single-rank engines in two processes, each taking half the prompts, and reports
their combined tokens over the wall time of the slower. All on the same 2 cores, so this shows
what splitting costs on a small machine rather than what it gains on a big one.

    python bench/parallel_throughput.py
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.workload import describe, machine_info  # noqa: E402

WORKLOAD = ROOT / "bench" / "prompts.json"


def _chats() -> tuple[list[list[dict[str, str]]], int]:
    data = json.loads(WORKLOAD.read_text())
    return [[{"role": "user", "content": p}] for p in data["prompts"]], int(data["output_tokens"])


def run_layout(tp: int, pp: int, chats: list, tokens: int, result: dict | None = None) -> dict:
    from rankcast import LLM, SamplingParams
    from rankcast.model.weight_snapshot import wait_for_writes

    llm = LLM(tensor_parallel_size=tp, pipeline_parallel_size=pp, kv_cache_space_gib=0.5)
    wait_for_writes()  # each rank's first-start snapshot, written in the background
    llm.chat(chats[:2], SamplingParams(temperature=0.0, max_tokens=4))
    start = time.perf_counter()
    outs = llm.chat(chats, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    elapsed = time.perf_counter() - start
    llm.shutdown()
    row = {"tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": elapsed}
    if result is not None:
        result.update(row)
    return row


def _dp_member(index: int, chats: list, tokens: int, queue: multiprocessing.Queue) -> None:
    os.environ["RANKCAST_NUM_THREADS"] = "1"  # two engines share the two cores
    queue.put((index, run_layout(1, 1, chats, tokens)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "parallel.json"))
    args = parser.parse_args()
    os.environ.setdefault("RANKCAST_DISABLE_PROGRESS", "1")
    os.environ.setdefault("RANKCAST_LOG_LEVEL", "WARNING")
    chats, tokens = _chats()
    rows = []
    for name, tp, pp in (("TP=1", 1, 1), ("TP=3", 3, 1), ("PP=2", 1, 2)):
        row = run_layout(tp, pp, chats, tokens)
        rows.append({"layout": name, "tokens_per_s": row["tokens"] / row["seconds"], **row})
    spawn = multiprocessing.get_context("spawn")
    queue = spawn.Queue()
    halves = [chats[0::2], chats[1::2]]
    members = [spawn.Process(target=_dp_member, args=(i, halves[i], tokens, queue)) for i in (0, 1)]
    for member in members:
        member.start()
    parts = dict(queue.get() for _ in members)
    for member in members:
        member.join()
    total = sum(p["tokens"] for p in parts.values())
    wall = max(p["seconds"] for p in parts.values())
    rows.append({"layout": "DP=2", "tokens_per_s": total / wall, "tokens": total, "seconds": wall})
    machine = machine_info()
    print(f"\nSmolLM2-135M, 32 prompts x {tokens} tokens, greedy, ignore_eos, dtype auto")
    print(f"{describe(machine)}\n")
    print(f"{'layout':<8}{'tok/s':>9}{'vs TP=1':>9}")
    base = rows[0]["tokens_per_s"]
    for row in rows:
        print(f"{row['layout']:<8}{row['tokens_per_s']:>9.1f}{row['tokens_per_s'] / base:>9.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
