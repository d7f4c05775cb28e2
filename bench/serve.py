"""Serving throughput and latency: N concurrent streaming clients against `rankcast serve`.

Standard workload (../shared/bench/prompts.json, chat template, 128 tokens, ignore_eos, greedy).
For each concurrency N in (1, 8, 32) it sends max(4, min(32, 2N)) requests with at most N in
flight and reports output tokens/s, time to first token and inter-token latency (p50/p99). The
same run also measures the offline `LLM` on the 32-prompt workload first, so the HTTP/IPC cost
is read side by side. Starts its own server unless --url is given.

    python bench/serve.py [--url http://127.0.0.1:8000] [--api-server-count 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
WORKLOAD = ROOT.parent / "shared" / "bench" / "prompts.json"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def one_request(
    http: httpx.AsyncClient,
    prompt: str,
    tokens: int,
    ttfts: list[float],
    itls: list[float],
    model: str | None = None,
) -> int:
    """One streaming chat request (on `model`, e.g. a LoRA adapter, if given); appends its
    time to first token and inter-token gaps, returns the tokens produced."""
    body: dict[str, object] = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model is not None:
        body["model"] = model
    start = time.perf_counter()
    last = None
    produced = 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                produced = chunk["usage"]["completion_tokens"]
                continue
            if not chunk["choices"] or not chunk["choices"][0]["delta"].get("content"):
                continue
            now = time.perf_counter()
            if last is None:
                ttfts.append(now - start)
            else:
                itls.append(now - last)
            last = now
    return produced


async def run_level(url: str, prompts: list[str], tokens: int, concurrency: int) -> dict:
    count = max(4, min(32, 2 * concurrency))
    batch = [prompts[i % len(prompts)] for i in range(count)]
    ttfts: list[float] = []
    itls: list[float] = []
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:

        async def guarded(prompt: str) -> int:
            async with gate:
                return await one_request(http, prompt, tokens, ttfts, itls)

        start = time.perf_counter()
        produced = sum(await asyncio.gather(*(guarded(p) for p in batch)))
        elapsed = time.perf_counter() - start
    return {
        "concurrency": concurrency,
        "requests": count,
        "output_tokens": produced,
        "tokens_per_s": produced / elapsed,
        "ttft_p50_ms": percentile(ttfts, 50) * 1000,
        "ttft_p99_ms": percentile(ttfts, 99) * 1000,
        "itl_p50_ms": percentile(itls, 50) * 1000,
        "itl_p99_ms": percentile(itls, 99) * 1000,
        "itl_mean_ms": statistics.fmean(itls) * 1000 if itls else float("nan"),
    }


def offline_throughput(prompts: list[str], tokens: int) -> float:
    from rankcast import LLM, SamplingParams

    llm = LLM(kv_cache_space_gib=1.0)
    chats = [[{"role": "user", "content": p}] for p in prompts]
    llm.chat(chats[:4], SamplingParams(temperature=0.0, max_tokens=4))
    start = time.perf_counter()
    outs = llm.chat(chats, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    elapsed = time.perf_counter() - start
    llm.shutdown()
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--api-server-count", type=int, default=1)
    parser.add_argument("--levels", default="1,8,32")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve.json"))
    args = parser.parse_args()
    os.environ.setdefault("RANKCAST_DISABLE_PROGRESS", "1")
    os.environ.setdefault("RANKCAST_LOG_LEVEL", "WARNING")
    data = json.loads(WORKLOAD.read_text())
    prompts, tokens = data["prompts"], int(data["output_tokens"])

    offline = offline_throughput(prompts, tokens)
    server = None
    url = args.url
    if url is None:
        from tests.entrypoints.server_process import ServerProcess

        server = ServerProcess(
            "--kv-cache-space",
            "1",
            "--max-num-seqs",
            "32",
            api_server_count=args.api_server_count,
        )
        server.wait_healthy()
        url = server.url
    try:
        levels = [
            asyncio.run(run_level(url, prompts, tokens, int(n))) for n in args.levels.split(",")
        ]
    finally:
        if server is not None:
            server.stop()

    print(f"\noffline LLM, 32 prompts x {tokens} tokens: {offline:.1f} output tokens/s\n")
    header = (
        f"{'N':>4}{'reqs':>6}{'tok/s':>9}{'vs offline':>12}"
        f"{'TTFT p50':>10}{'p99':>8}{'ITL p50':>9}{'p99':>8}"
    )
    print(header + "   (ms)")
    for row in levels:
        print(
            f"{row['concurrency']:>4}{row['requests']:>6}{row['tokens_per_s']:>9.1f}"
            f"{row['tokens_per_s'] / offline:>12.2f}{row['ttft_p50_ms']:>10.0f}"
            f"{row['ttft_p99_ms']:>8.0f}{row['itl_p50_ms']:>9.1f}{row['itl_p99_ms']:>8.1f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "workload": {"output_tokens": tokens, "ignore_eos": True, "greedy": True},
                "api_server_count": args.api_server_count,
                "offline_tokens_per_s": offline,
                "levels": levels,
            },
            indent=2,
        )
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot(
            [r["concurrency"] for r in levels],
            [r["tokens_per_s"] for r in levels],
            "o-",
            label="rankcast serve",
        )
        ax.axhline(offline, linestyle="--", color="gray", label="offline LLM (32 prompts)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streaming clients")
        ax.set_ylabel("output tokens/s")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
    except ImportError:
        pass
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
