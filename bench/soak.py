"""Soak: minutes of mixed serving, and the memory of every process of the fleet over time.

`rankcast serve` of the embedded SmolLM2 (`--kv-cache-space 1`, LoRA on with two real PEFT
adapters on one device slot, two API servers) under a mixed load for `--minutes`: streaming
chats that share long system prompts (the prefix cache cycles its blocks), half of the clients
hanging up mid-stream, a third of the requests on an adapter (the slot changes hands). Every
`--interval` seconds the resident memory (RSS) of every process of the fleet is sampled. After
the warm-up (the first fifth of the run, at least one minute) each process must stay flat: its
RSS at the end at most 5 % above its RSS when the warm-up ended.

Prints a table (RSS per role at the end of warm-up and at the end, growth), writes JSON and a
PNG of RSS over time per process under bench/results/. No anchor: this measures rankcast's own
memory over time, which has no like-for-like figure in another engine's run.

    python bench/soak.py [--minutes 10] [--clients 8]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.workload import describe, machine_info  # noqa: E402
from tests.entrypoints.server_process import ServerProcess, descendants  # noqa: E402

GROWTH_LIMIT = 0.05
PAGE = 4096


def rss_bytes(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return None


def role_of(pid: int) -> str:
    """`engine_core_dp0`, `worker_dp0_pp0_tp0`, `api_server_1`, ... (the process title)."""
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return f"pid {pid}"
    return title.removeprefix("rankcast::") if title.startswith("rankcast::") else f"pid {pid}"


def sample(launcher: int, started: float, series: dict[str, list[tuple[float, int]]]) -> None:
    now = time.monotonic() - started
    for pid in [launcher, *descendants(launcher)]:
        rss = rss_bytes(pid)
        role = "launcher" if pid == launcher else role_of(pid)
        if rss is not None and not role.startswith("pid "):
            series.setdefault(role, []).append((now, rss))


def make_adapters(out: Path) -> list[tuple[str, Path]]:
    from rankcast.model_files.source import resolve_model
    from tests.lora.conftest import make_adapter

    model_dir = resolve_model(None).model_dir
    adapters = []
    for rank in (4, 8):
        path = out / f"r{rank}"
        if not (path / "adapter_model.safetensors").exists():
            make_adapter(model_dir, path, rank=rank, alpha=2 * rank)
        adapters.append((f"soak-r{rank}", path))
    return adapters


def client(url: str, index: int, stop: threading.Event, counts: dict[str, int]) -> None:
    """Back-to-back streaming chats: odd clients hang up after a few chunks."""
    rng = random.Random(index)
    systems = [f"You are assistant {k}. " + "Answer briefly and precisely. " * 40 for k in range(4)]
    while not stop.is_set():
        model = rng.choice(["soak-r4", "soak-r8", None, None, None, None])
        body: dict[str, Any] = {
            "messages": [
                {"role": "system", "content": rng.choice(systems)},
                {"role": "user", "content": f"Question {rng.randrange(10_000)}: name a city."},
            ],
            "max_tokens": 48,
            "stream": True,
        }
        if model:
            body["model"] = model
        hang_up_after = rng.randrange(1, 8) if index % 2 else None
        outcome = "completed"
        try:
            with (
                httpx.Client(timeout=httpx.Timeout(10, read=120)) as http,
                http.stream("POST", f"{url}/v1/chat/completions", json=body) as response,
            ):
                if response.status_code != 200:
                    outcome = f"status {response.status_code}"
                else:
                    for chunks, _ in enumerate(response.iter_lines()):
                        if hang_up_after is not None and chunks >= hang_up_after:
                            outcome = "hung up"
                            break
        except httpx.HTTPError as exc:
            outcome = type(exc).__name__
        counts[outcome] = counts.get(outcome, 0) + 1


def summarize(series: dict[str, list[tuple[float, int]]], warm_up_s: float) -> list[dict[str, Any]]:
    rows = []
    for role, points in sorted(series.items()):
        after = [rss for t, rss in points if t >= warm_up_s]
        if not after:
            continue
        start, end = after[0], after[-1]
        rows.append(
            {
                "role": role,
                "rss_first_mb": points[0][1] / 2**20,
                "rss_warm_mb": start / 2**20,
                "rss_end_mb": end / 2**20,
                "rss_peak_mb": max(after) / 2**20,
                "growth": end / start - 1,
                "flat": end <= start * (1 + GROWTH_LIMIT),
            }
        )
    return rows


def plot(series: dict[str, list[tuple[float, int]]], warm_up_s: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for role, points in sorted(series.items()):
        ax.plot([t / 60 for t, _ in points], [rss / 2**20 for _, rss in points], label=role)
    ax.axvline(warm_up_s / 60, color="grey", linestyle=":", label="end of warm-up")
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title("rankcast serve under a mixed soak: memory of every process")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "soak.json"))
    args = parser.parse_args()
    machine = machine_info()
    print(f"Machine: {describe(machine)}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    adapters = make_adapters(out.parent / "soak-adapters")
    lora_modules = [f"{name}={path}" for name, path in adapters]
    server = ServerProcess(
        "--kv-cache-space", "1", "--enable-lora", "--max-loras", "1", "--max-cpu-loras", "2",
        "--max-lora-rank", "8", "--lora-modules", *lora_modules, api_server_count=2,
    )  # fmt: skip
    series: dict[str, list[tuple[float, int]]] = {}
    counts: dict[str, int] = {}
    duration = args.minutes * 60
    warm_up = max(60.0, duration / 5)
    with server.running():
        started = time.monotonic()
        stop = threading.Event()
        threads = [
            threading.Thread(target=client, args=(server.url, i, stop, counts), daemon=True)
            for i in range(args.clients)
        ]
        for thread in threads:
            thread.start()
        while time.monotonic() - started < duration:
            sample(server.proc.pid, started, series)
            time.sleep(args.interval)
        sample(server.proc.pid, started, series)
        stop.set()
        for thread in threads:
            thread.join(150)
    rows = summarize(series, warm_up)
    print(
        f"\n{args.minutes:g} min, {args.clients} clients (half hang up mid-stream), "
        f"warm-up {warm_up / 60:.1f} min; requests: {counts}"
    )
    print(f"{'process':<22} {'first':>8} {'warm':>8} {'end':>8} {'peak':>8} {'growth':>8}  flat")
    for row in rows:
        print(
            f"{row['role']:<22} {row['rss_first_mb']:>7.0f}M {row['rss_warm_mb']:>7.0f}M "
            f"{row['rss_end_mb']:>7.0f}M {row['rss_peak_mb']:>7.0f}M {100 * row['growth']:>7.1f}%"
            f"  {'yes' if row['flat'] else 'NO'}"
        )
    png = out.with_suffix(".png")
    plot(series, warm_up, png)
    out.write_text(
        json.dumps(
            {
                "machine": machine,
                "minutes": args.minutes,
                "clients": args.clients,
                "warm_up_s": warm_up,
                "requests": counts,
                "processes": rows,
                "series": {role: points for role, points in series.items()},
            },
            indent=1,
        )
        + "\n"
    )
    print(f"\nwrote {out} and {png}")


if __name__ == "__main__":
    main()
