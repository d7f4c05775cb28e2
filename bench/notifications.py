"""The engine notification channel, measured: latency, cost, and capacity.

(a) Latency from publish in a worker rank to visible on *every* API server (read on each
    server's `/v1/events` stream; the latest of the servers counts), p50/p99, for the doorbell
    vs the poll alone (`--no-worker-notification-doorbell --worker-notification-poll-interval`),
    with the engine idle vs busy decoding. SmolLM2-135M, one mp rank, two API servers.
(b) Offline decode throughput on the standard workload with the channel quiet vs 1,000 events/s
    published by every rank (overhead in %), for one and two mp ranks (PP=2).
(c) The highest sustained events/s per rank with no drop and every event on every API server,
    for world sizes 1, 2, 4 (tiny model: TP=1, TP=2, TP=2 x PP=2) and 1, 2, 4 API servers.

Prints tables, writes bench/results/notifications.json and notifications.png.

    python bench/notifications.py            # all parts (about 10 minutes on 2 cores)
    python bench/notifications.py --parts c  # one part
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
WORKLOAD = ROOT / "bench" / "prompts.json"
RESULTS = ROOT / "bench" / "results"
EXTENSION = "bench.event_load:EventLoad"

from tests.entrypoints.server_process import ServerProcess  # noqa: E402

# ---- helpers ----


class TimedEventReader:
    """One `/v1/events` stream; records (receipt wall time, event) for each event."""

    def __init__(self, url: str, params: dict[str, str]) -> None:
        self.client = httpx.Client(timeout=httpx.Timeout(10, read=None))
        request = self.client.build_request("GET", f"{url}/v1/events", params=params)
        self.response = self.client.send(request, stream=True)
        self.server = self.response.headers["x-rankcast-api-server"]
        self.events: list[tuple[float, dict[str, Any]]] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for line in self.response.iter_lines():
                if line.startswith("data: "):
                    self.events.append((time.time(), json.loads(line[6:])))
        except httpx.HTTPError:
            return

    def close(self) -> None:
        self.response.close()
        self.client.close()


def readers_for_every_server(
    url: str, count: int, params: dict[str, str]
) -> list[TimedEventReader]:
    readers: dict[str, TimedEventReader] = {}
    while len(readers) < count:
        reader = TimedEventReader(url, params)
        if reader.server in readers:
            reader.close()
        else:
            readers[reader.server] = reader
    return list(readers.values())


def rpc(url: str, method: str, *args: Any) -> Any:
    response = httpx.post(
        f"{url}/collective_rpc", json={"method": method, "args": list(args)}, timeout=60
    )
    response.raise_for_status()
    return response.json()["results"]


def scrape_each(url: str, count: int) -> dict[str, str]:
    samples: dict[str, str] = {}
    while len(samples) < count:
        response = httpx.get(f"{url}/metrics", timeout=10)
        samples[response.headers["x-rankcast-api-server"]] = response.text
    return samples


def metric_sum(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def start_server(args: list[str], api_servers: int) -> ServerProcess:
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    server = ServerProcess(
        *args, "--worker-extension-cls", EXTENSION, api_server_count=api_servers, env=env
    )
    try:
        server.wait_healthy(timeout_s=600)
    except Exception:
        server.kill()
        raise
    return server


# ---- (a) latency ----


def _busy_load(url: str, stop: threading.Event, clients: int) -> list[threading.Thread]:
    def loop() -> None:
        with httpx.Client(timeout=300) as http:
            while not stop.is_set():
                http.post(
                    f"{url}/v1/completions",
                    json={"prompt": "Tell me a story.", "max_tokens": 64, "ignore_eos": True},
                )

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    return threads


def part_a(events: int, rate: float) -> list[dict[str, Any]]:
    rows = []
    modes = {
        "doorbell": ["--distributed-executor-backend", "mp"],
        "poll 50 ms": [
            "--distributed-executor-backend",
            "mp",
            "--no-worker-notification-doorbell",
            "--worker-notification-poll-interval",
            "0.05",
        ],
    }
    for mode, flags in modes.items():
        server = start_server([*flags, "--max-num-seqs", "8", "--kv-cache-space", "0.5"], 2)
        try:
            for load in ("idle", "busy"):
                key = f"bench.latency.{load}"
                readers = readers_for_every_server(server.url, 2, {"key": key})
                stop = threading.Event()
                busy = _busy_load(server.url, stop, 8) if load == "busy" else []
                time.sleep(2.0 if busy else 0.2)
                rpc(server.url, "start_event_load", rate, events / rate, key)
                deadline = time.monotonic() + events / rate + 60
                while any(len(r.events) < events for r in readers):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{mode}/{load}: events did not all arrive")
                    time.sleep(0.05)
                stop.set()
                for thread in busy:
                    thread.join()
                for reader in readers:
                    reader.close()
                latest: dict[str, float] = {}
                published: dict[str, float] = {}
                for reader in readers:
                    for received, event in reader.events:
                        ident = f"{event['engine_index']}:{event['engine_seq']}"
                        latest[ident] = max(latest.get(ident, 0.0), received)
                        published[ident] = event["timestamp"]
                lags = [(latest[i] - published[i]) * 1000 for i in latest]
                row = {
                    "mode": mode,
                    "engine": load,
                    "events": len(lags),
                    "p50_ms": percentile(lags, 0.5),
                    "p99_ms": percentile(lags, 0.99),
                    "max_ms": max(lags),
                }
                rows.append(row)
                print(
                    f"  (a) {mode:<11} {load:<5} p50 {row['p50_ms']:7.1f} ms  "
                    f"p99 {row['p99_ms']:7.1f} ms  ({row['events']} events)",
                    flush=True,
                )
        finally:
            server.stop()
    return rows


# ---- (b) throughput overhead ----


def _offline_run(
    world: dict[str, int], rate: float | None, publish: bool = True
) -> dict[str, float]:
    from rankcast import LLM, SamplingParams

    data = json.loads(WORKLOAD.read_text())
    chats = [[{"role": "user", "content": p}] for p in data["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=int(data["output_tokens"]), ignore_eos=True)
    llm = LLM(
        distributed_executor_backend="mp",
        worker_extension_cls=EXTENSION,
        kv_cache_space_gib=0.5,
        **world,
    )
    try:
        llm.chat(chats[:2], SamplingParams(temperature=0.0, max_tokens=4))
        llm.take_notifications()
        engine_seconds = _time_engine_side(llm)
        if rate:
            llm.collective_rpc("start_event_load", [rate, 120.0, "bench.overhead", publish])
        start = time.perf_counter()
        outs = llm.chat(chats, params)
        seconds = time.perf_counter() - start
        rank_seconds = sum(llm.collective_rpc("stop_event_load")) if rate else 0.0
        delivered = sum(
            1 for n in llm.take_notifications() if getattr(n, "key", "") == "bench.overhead"
        )
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return {
            "tokens_per_s": tokens / seconds,
            "events_delivered": delivered,
            "seconds": seconds,
            # Time inside the channel's own code during the run, as a share of it: the ranks'
            # publish calls plus the engine's receive, flush and decode (all on the step's path).
            "accounted_pct": (rank_seconds + engine_seconds[0]) / seconds * 100,
            "rank_publish_pct": rank_seconds / seconds * 100,
        }
    finally:
        llm.shutdown()


def _time_engine_side(llm: Any) -> list[float]:
    """Wrap the engine's channel calls (receive, gather, flush, the offline decode) so their
    time adds up in the returned cell: a figure that run-to-run noise does not move."""
    core = llm.engine.client.core
    spent = [0.0]
    targets = [(core.notifications, name) for name in ("receive", "gather", "flush")]
    for owner, name in [*targets, (llm.engine, "_keep")]:
        call = getattr(owner, name)

        def timed(*args: Any, _call: Any = call) -> Any:
            began = time.perf_counter()
            try:
                return _call(*args)
            finally:
                spent[0] += time.perf_counter() - began

        setattr(owner, name, timed)
    return spent


def part_b(rate: float, repeats: int) -> list[dict[str, Any]]:
    rows = []
    for name, world in (("1 rank", {}), ("PP=2", {"pipeline_parallel_size": 2})):
        runs: dict[str, list[dict[str, float]]] = {"quiet": [], "thread": [], "loaded": []}
        kinds = list(runs)
        for repeat in range(repeats):
            # Interleaved, and in a rotated order each time: drift in the machine and the cost
            # of coming right after another engine's shutdown hit every kind alike.
            for kind in kinds[repeat % 3 :] + kinds[: repeat % 3]:
                load = {"quiet": None, "thread": rate, "loaded": rate}[kind]
                runs[kind].append(_offline_run(world, load, publish=kind == "loaded"))
        quiet, thread, loaded = (
            statistics.median(r["tokens_per_s"] for r in runs[kind]) for kind in kinds
        )
        # Each repeat's own pair (its loaded run against its pacing-thread run), then the
        # median: one slow run moves one pair, not the figure.
        pairs = [
            (1 - a["tokens_per_s"] / b["tokens_per_s"]) * 100
            for a, b in zip(runs["loaded"], runs["thread"], strict=True)
        ]
        events_per_s = statistics.mean(r["events_delivered"] / r["seconds"] for r in runs["loaded"])
        accounted = statistics.median(r["accounted_pct"] for r in runs["loaded"])
        accounted_control = statistics.median(r["accounted_pct"] for r in runs["thread"])
        row = {
            "layout": name,
            "quiet_tok_s": quiet,
            "pacing_thread_only_tok_s": thread,
            "loaded_tok_s": loaded,
            "overhead_pct": (1 - loaded / quiet) * 100,
            "channel_overhead_pct": statistics.median(pairs),
            "channel_overhead_pct_per_repeat": pairs,
            "channel_accounted_pct": accounted,
            "control_accounted_pct": accounted_control,
            "events_per_s_delivered": events_per_s,
            "runs": runs,
        }
        rows.append(row)
        spread = ", ".join(f"{p:+.1f}" for p in pairs)
        print(
            f"  (b) {name:<6} quiet {quiet:6.1f} tok/s | pacing thread, no events {thread:6.1f} | "
            f"{rate:.0f} ev/s/rank {loaded:6.1f} tok/s (medians): overhead "
            f"{row['overhead_pct']:+5.1f} % (channel alone {row['channel_overhead_pct']:+5.1f} %, "
            f"median of repeats {spread}; {events_per_s:.0f} ev/s delivered); time inside the "
            f"channel's code {accounted:.2f} % of the run "
            f"(pacing thread alone {accounted_control:.2f} %)",
            flush=True,
        )
    return rows


# ---- (c) capacity ----

WORLDS = {
    1: ["--tensor-parallel-size", "1", "--distributed-executor-backend", "mp"],
    2: ["--tensor-parallel-size", "2"],
    4: ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"],
}


def _try_rate(server: ServerProcess, servers: int, world: int, rate: int, seconds: float) -> bool:
    key = f"bench.capacity.{rate}"
    before = scrape_each(server.url, servers)
    dropped_before = {
        i: metric_sum(t, "rankcast:worker_notifications_dropped_total") for i, t in before.items()
    }
    rpc(server.url, "start_event_load", rate, seconds, key)
    want = int(rate * seconds) * world
    deadline = time.monotonic() + seconds + 15
    time.sleep(seconds)
    while True:
        scrapes = scrape_each(server.url, servers)
        dropped = any(
            metric_sum(t, "rankcast:worker_notifications_dropped_total") > dropped_before[i]
            for i, t in scrapes.items()
        )
        counts = [
            metric_sum(t, "rankcast:engine_notifications_total", key=key) for t in scrapes.values()
        ]
        if dropped:
            return False
        if all(c >= want for c in counts):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)


def part_c(model: str, rates: list[int], seconds: float) -> list[dict[str, Any]]:
    rows = []
    for world, flags in WORLDS.items():
        for servers in (1, 2, 4):
            server = start_server(
                [model, "--dtype", "float32", "--kv-cache-space", "0.05", *flags], servers
            )
            best = 0
            try:
                for rate in rates:
                    if not _try_rate(server, servers, world, rate, seconds):
                        break
                    best = rate
            finally:
                server.stop()
            rows.append(
                {
                    "world_size": world,
                    "api_servers": servers,
                    "max_events_per_s_per_rank": best,
                    "max_events_per_s_total": best * world,
                }
            )
            print(
                f"  (c) world {world} x {servers} API servers: {best} events/s per rank "
                f"({best * world} in all) with no drop",
                flush=True,
            )
    return rows


# ---- report ----


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    if results.get("a"):
        rows = results["a"]
        labels = [f"{r['mode']}\n{r['engine']}" for r in rows]
        x = range(len(rows))
        axes[0].bar([i - 0.2 for i in x], [r["p50_ms"] for r in rows], 0.4, label="p50")
        axes[0].bar([i + 0.2 for i in x], [r["p99_ms"] for r in rows], 0.4, label="p99")
        axes[0].set_xticks(list(x), labels)
        axes[0].set_ylabel("publish -> every API server (ms)")
        axes[0].set_title("(a) delivery latency")
        axes[0].legend()
    if results.get("b"):
        rows = results["b"]
        x = range(len(rows))
        width = 0.27
        bars = (
            ("quiet_tok_s", "quiet"),
            ("pacing_thread_only_tok_s", "thread, no events"),
            ("loaded_tok_s", "1,000 ev/s per rank"),
        )
        for n, (field, label) in enumerate(bars):
            offsets = [i + (n - 1) * width for i in x]
            axes[1].bar(offsets, [r[field] for r in rows], width, label=label)
        axes[1].set_xticks(list(x), [r["layout"] for r in rows])
        axes[1].set_ylabel("decode tokens/s")
        axes[1].set_title("(b) channel cost on throughput")
        axes[1].legend()
    if results.get("c"):
        rows = results["c"]
        for world in sorted({r["world_size"] for r in rows}):
            mine = [r for r in rows if r["world_size"] == world]
            axes[2].plot(
                [r["api_servers"] for r in mine],
                [r["max_events_per_s_per_rank"] for r in mine],
                marker="o",
                label=f"world {world}",
            )
        axes[2].set_xlabel("API servers")
        axes[2].set_ylabel("max events/s per rank, no drop")
        axes[2].set_xticks([1, 2, 4])
        axes[2].set_title("(c) sustained capacity")
        axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", default="abc")
    parser.add_argument("--latency-events", type=int, default=60)
    parser.add_argument("--latency-rate", type=float, default=7.3)  # not a multiple of the poll
    parser.add_argument("--overhead-rate", type=float, default=1000.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--capacity-seconds", type=float, default=3.0)
    parser.add_argument("--rates", default="1000,2000,4000,8000,16000,32000")
    parser.add_argument("--out", default=str(RESULTS / "notifications.json"))
    parser.add_argument(
        "--plot-only", action="store_true", help="redraw the PNG from an existing --out file"
    )
    args = parser.parse_args()
    os.environ.setdefault("RANKCAST_DISABLE_PROGRESS", "1")
    os.environ.setdefault("RANKCAST_LOG_LEVEL", "WARNING")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.plot_only:
        plot(json.loads(out.read_text()), out.with_suffix(".png"))
        return
    results: dict[str, Any] = {}
    if "a" in args.parts:
        print("(a) latency, publish -> visible on every API server", flush=True)
        results["a"] = part_a(args.latency_events, args.latency_rate)
    if "b" in args.parts:
        print("(b) decode throughput, quiet vs loaded channel", flush=True)
        results["b"] = part_b(args.overhead_rate, args.repeats)
    if "c" in args.parts:
        print("(c) sustained events/s with no drop", flush=True)
        model = _tiny_model(RESULTS / "tiny-llama")
        rates = [int(r) for r in args.rates.split(",")]
        results["c"] = part_c(str(model), rates, args.capacity_seconds)
    out.write_text(json.dumps(results, indent=2))
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def _tiny_model(path: Path) -> Path:
    """The tests' tiny random-weight model (4 heads, 2 KV heads: TP=2 and PP=2 both fit)."""
    if (path / "config.json").exists():
        return path
    from rankcast.model_files.source import resolve_model
    from tests.conftest import write_tiny_model

    return write_tiny_model(path, tokenizer_from=resolve_model(None).model_dir)


if __name__ == "__main__":
    main()
