"""What an open dashboard costs the API server, and the README's screenshot of it.

`cost` (default): one `rankcast serve` (the embedded SmolLM2, one API server). First the page's
own cost, precisely: the API server's CPU seconds (/proc schedstat) over 30 s idle without a
page, then over 30 s with the dashboard open in a headless Chromium (polling /health and /metrics
every 2 s, streaming /v1/events). Then the standard workload at 32 concurrent streams (bench/
serve.py's client, 288 requests a run) `--runs` times without the page and as many with it,
alternating: the API server's CPU per second and per 1,000 output tokens, and tokens/s. The
page's share is its CPU per second over the API server's CPU per second at 32 streams (the
issue's bar: at most 1 %); the paired runs are the cross-check, inside their run-to-run spread.
Chromium's own CPU is not the API server's, but it runs on the same two cores, so tokens/s shows
what it takes from the engine too. No anchor runs beside it: neither vLLM nor llama.cpp serves
such a page, so the figure is the share of rankcast's own API server, as the issue asks.

`screenshot`: the page during a LoRA load on SmolLM2 with `--tensor-parallel-size 3`
(docs/images/dashboard.png), after a few requests so the sparklines have something to show.

    python bench/dashboard.py [cost|screenshot] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.serve import run_level  # noqa: E402
from bench.workload import describe, load_prompts, machine_info  # noqa: E402

CONCURRENCY = 32
TOKENS = 64
REQUESTS = 288
IDLE_S = 30.0


def cpu_seconds(pid: int) -> float:
    """CPU seconds the process's threads have run, in nanoseconds' precision (/proc/<pid>/
    schedstat; /proc/<pid>/stat counts in 10 ms ticks, as coarse as what is measured here)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended meanwhile
    return total / 1e9


@contextmanager
def page_open(url: str) -> Iterator[None]:
    """The dashboard open and streaming in a headless Chromium for the duration."""
    from tests.dashboard.browser import chromium, wait_for_stream

    with chromium() as browser:
        browser.get(f"{url}/dashboard")
        wait_for_stream(browser)
        yield


def one_run(url: str, api_server: int, prompts: list[str], with_page: bool) -> dict[str, Any]:
    with page_open(url) if with_page else nullcontext():
        time.sleep(3)  # the page's first polls, as a page left open would have done
        before = cpu_seconds(api_server)
        row = asyncio.run(run_level(url, prompts, TOKENS, CONCURRENCY, count=REQUESTS))
        used = cpu_seconds(api_server) - before
    return {
        "page": with_page,
        "api_server_cpu_s": used,
        "api_server_cpu_per_s": used * row["tokens_per_s"] / row["output_tokens"],
        "cpu_ms_per_1k_tokens": used * 1e6 / row["output_tokens"],
        "tokens_per_s": row["tokens_per_s"],
        "seconds": row["output_tokens"] / row["tokens_per_s"],
    }


def cost(runs: int) -> None:
    from tests.dashboard.browser import find_chromium
    from tests.entrypoints.server_process import ServerProcess

    found = find_chromium()
    if isinstance(found, str):
        sys.exit(f"no headless Chromium: {found}")
    prompts, _ = load_prompts()
    server = ServerProcess("--kv-cache-space", "1", "--max-num-seqs", "32", api_server_count=1)
    rows = []
    with server.running():
        api_server = server.pid_of("api_server_0")
        asyncio.run(run_level(server.url, prompts, TOKENS, 4))  # warm-up
        idle: dict[str, float] = {}
        for label, context in (("closed", nullcontext()), ("open", page_open(server.url))):
            with context:
                time.sleep(3)
                before = cpu_seconds(api_server)
                time.sleep(IDLE_S)
                idle[label] = (cpu_seconds(api_server) - before) / IDLE_S
        for _ in range(runs):
            for with_page in (False, True):
                rows.append(one_run(server.url, api_server, prompts, with_page))
    machine = machine_info()

    def median(page: bool, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["page"] is page)

    without, with_ = median(False, "cpu_ms_per_1k_tokens"), median(True, "cpu_ms_per_1k_tokens")
    paired = (with_ - without) / without
    page_cost = idle["open"] - idle["closed"]
    busy = median(False, "api_server_cpu_per_s")
    share = page_cost / busy
    print(f"\nthe dashboard's cost to the API server; measured on {describe(machine)}")
    print(
        f"idle: {idle['closed'] * 1000:.2f} ms of CPU per second without the page, "
        f"{idle['open'] * 1000:.2f} with it open: the page costs {page_cost * 1000:.2f} ms/s"
    )
    print(f"at {CONCURRENCY} concurrent streams, {runs} runs each, alternating:")
    print(f"{'page':<10} {'API CPU s':>10} {'CPU ms/s':>9} {'ms/1k tok':>10} {'tok/s':>8}")
    for r in rows:
        print(
            f"{'open' if r['page'] else 'closed':<10} {r['api_server_cpu_s']:>10.2f} "
            f"{r['api_server_cpu_per_s'] * 1000:>9.0f} {r['cpu_ms_per_1k_tokens']:>10.1f} "
            f"{r['tokens_per_s']:>8.1f}"
        )
    tps = median(True, "tokens_per_s") / median(False, "tokens_per_s")
    print(
        f"the page's share of the API server's CPU at {CONCURRENCY} streams: "
        f"{page_cost * 1000:.2f} / {busy * 1000:.0f} ms/s = {share:.2%}\n"
        f"paired medians (cross-check): {without:.1f} -> {with_:.1f} ms of API-server CPU per "
        f"1,000 tokens ({paired:+.1%}); tokens/s with the page open {tps:.2f}x"
    )
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    result = {
        "machine": machine,
        "idle_cpu_per_s": idle,
        "runs": rows,
        "page_share_of_api_server_cpu": share,
        "paired_cpu_per_token_change": paired,
        "tokens_ratio": tps,
    }
    (out / "dashboard-cost.json").write_text(json.dumps(result, indent=2))


def screenshot() -> None:
    """The page on SmolLM2 with TP=3 while an adapter loads on every rank."""
    from bench.lora import make_adapters
    from rankcast.model_files.source import resolve_model
    from tests.dashboard.browser import chromium, wait_for_stream
    from tests.entrypoints.server_process import ServerProcess

    adapters = make_adapters(
        resolve_model(None).model_dir, ROOT / "bench" / "results" / "adapters", 2, 8
    )
    server = ServerProcess(
        "--tensor-parallel-size", "3", "--kv-cache-space", "0.5",
        "--enable-lora", "--max-loras", "1", "--max-cpu-loras", "2", "--max-lora-rank", "8",
        "--lora-modules", f"support={adapters[0]}",
        "--allowed-lora-paths", str(adapters[1].parent), "--allow-runtime-lora-updating",
        api_server_count=2,
    )  # fmt: skip
    prompts, _ = load_prompts()
    path = ROOT / "docs" / "images" / "dashboard.png"
    path.parent.mkdir(exist_ok=True)
    with server.running(), chromium(1500, 740) as browser:
        browser.get(f"{server.url}/dashboard")
        wait_for_stream(browser)
        for _ in range(3):
            asyncio.run(run_level(server.url, prompts, 32, 8, count=16))
            asyncio.run(run_level(server.url, prompts, 32, 4, model="support", count=8))
        loaded = httpx.post(
            f"{server.url}/v1/load_lora_adapter",
            json={"lora_name": "billing", "lora_path": str(adapters[1])},
            timeout=60,
        )
        assert loaded.status_code == 200, loaded.text
        asyncio.run(run_level(server.url, prompts, 32, 4, model="billing", count=8))
        time.sleep(2.5)  # one more poll after the load
        browser.save_screenshot(str(path))
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", nargs="?", default="cost", choices=("cost", "screenshot"))
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if args.what == "cost":
        cost(args.runs)
    else:
        screenshot()


if __name__ == "__main__":
    main()
