"""LoRA serving, SmolLM2-135M, adapters made here with `peft` (r=8, all seven projections).

Part `overhead` (offline, standard workload: 32 prompts x 128 tokens), one after another in one
process: the base model without LoRA; with LoRA enabled and no request using an adapter; every
request on one adapter; requests spread over four adapters, with 4 and with 16 device slots.

Part `zipf` (a real `rankcast serve`, streaming chat clients): 20 adapters registered at start,
requests choose one by Zipf popularity (s=1, seeded), `--max-loras 4`, N requests in flight.
Side by side: the base model (no adapter named), the host tier as small as the device tier
(`--max-cpu-loras 4`: a miss reads the adapter from disk), the host tier holding all 20 (a
miss copies from host memory), and the same with 8 device slots. Reports throughput, TTFT
p50/p99 and, from the server's own `rankcast:lora_adapter_events_total`, disk loads,
activations and evictions per minute.

    python bench/lora.py [--part overhead|zipf|all] [--requests 96] [--concurrency 16]
                         [--baseline DIR]  # Zipf runs of an earlier checkout, side by side
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.serve import client_session, one_request, percentile  # noqa: E402
from bench.workload import describe, machine_info  # noqa: E402

WORKLOAD = ROOT / "bench" / "prompts.json"
RESULTS = ROOT / "bench" / "results"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_dir: Path, root: Path, count: int, rank: int) -> list[Path]:
    import peft
    import torch
    import transformers

    paths = []
    for i in range(count):
        path = root / f"smollm-r{rank}-{i}"
        if not (path / "adapter_model.safetensors").exists():
            torch.manual_seed(i)
            base = transformers.AutoModelForCausalLM.from_pretrained(
                str(model_dir), dtype=torch.float32
            )
            config = peft.LoraConfig(
                r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False
            )
            model = peft.get_peft_model(base, config)
            # peft's random init is large for a real model; keep the deltas modest.
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if "lora_B" in name:
                        param.mul_(0.01)
            model.save_pretrained(str(path))
        paths.append(path)
    return paths


def run(
    enable_lora: bool, adapters: list[Path], chats: list, tokens: int, slots: int = 4
) -> dict[str, float]:
    from rankcast import LLM, LoRARequest, SamplingParams
    from rankcast.model.weight_snapshot import wait_for_writes

    kwargs = {"enable_lora": True, "max_loras": slots, "max_lora_rank": 8} if enable_lora else {}
    llm = LLM(kv_cache_space_gib=0.5, **kwargs)
    wait_for_writes()  # a first start's snapshot, written in the background, is not timed
    try:
        requests = None
        if adapters:
            requests = [
                LoRARequest(adapters[i % len(adapters)].name, str(adapters[i % len(adapters)]))
                for i in range(len(chats))
            ]
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        warm = SamplingParams(temperature=0.0, max_tokens=4)
        prompts = [llm.engine.apply_chat_template(c) for c in chats]
        llm.generate(prompts[:2], warm, lora_request=requests[:2] if requests else None)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=requests)
        seconds = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        return {"tokens": generated, "seconds": seconds, "tokens_per_s": generated / seconds}
    finally:
        llm.shutdown()


def overhead_part(adapters: list[Path], chats: list, tokens: int) -> list[dict[str, Any]]:
    rows = []
    for name, enable, used, slots in (
        ("base, LoRA off", False, [], 4),
        ("base, LoRA on", True, [], 4),
        ("1 adapter r=8", True, adapters[:1], 4),
        ("4 adapters r=8", True, adapters[:4], 4),
        # What a slot costs: the masked matmuls span every slot, used or not.
        ("4 adapters, 16 slots", True, adapters[:4], 16),
    ):
        rows.append({"run": name, "max_loras": slots, **run(enable, used, chats, tokens, slots)})
    base = rows[0]["tokens_per_s"]
    print(f"\n{'run':<22} {'tok/s':>8} {'x base':>7}")
    for row in rows:
        row["x_base"] = row["tokens_per_s"] / base
        print(f"{row['run']:<22} {row['tokens_per_s']:8.1f} {row['x_base']:7.2f}")
    return rows


def zipf_choices(count: int, adapters: int, seed: int = 0, s: float = 1.0) -> list[int]:
    """Adapter index per request: index i is chosen with weight 1 / (i + 1)^s."""
    weights = [1 / (i + 1) ** s for i in range(adapters)]
    return random.Random(seed).choices(range(adapters), weights=weights, k=count)


def lifecycle_counts(url: str) -> dict[tuple[str, str], float]:
    """(event, reason) -> count, summed over adapters, from the server's /metrics."""
    counts: dict[tuple[str, str], float] = {}
    pattern = re.compile(r'event="([^"]*)",reason="([^"]*)"\} (\S+)')
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("rankcast:lora_adapter_events_total{"):
            match = pattern.search(line)
            if match:
                key = (match.group(1), match.group(2))
                counts[key] = counts.get(key, 0.0) + float(match.group(3))
    return counts


async def _load(url: str, models: list[str | None], prompts: list[str], tokens: int, n: int):
    """Send one streaming request per entry of `models`, `n` in flight: (TTFTs, tokens, s)."""
    ttfts: list[float] = []
    gate = asyncio.Semaphore(n)
    async with client_session(url, n + 4) as http:

        async def guarded(i: int, model: str | None) -> int:
            async with gate:
                prompt = prompts[i % len(prompts)]
                return await one_request(http, prompt, tokens, ttfts, [], model)

        start = time.perf_counter()
        produced = sum(await asyncio.gather(*(guarded(i, m) for i, m in enumerate(models))))
        return ttfts, produced, time.perf_counter() - start


def zipf_run(
    label: str,
    adapters: list[Path],
    cpu_loras: int | None,
    args: argparse.Namespace,
    data: dict,
    slots: int = 4,
    tree: Path | None = None,
) -> dict[str, Any]:
    from rankcast.model.weight_snapshot import wait_for_writes
    from tests.entrypoints.server_process import ServerProcess

    names = [f"a{i:02d}" for i in range(len(adapters))]
    flags = ["--kv-cache-space", "1", "--max-num-seqs", "32"]
    if cpu_loras is not None:
        flags += ["--enable-lora", "--max-loras", str(slots), "--max-cpu-loras", str(cpu_loras)]
        flags += ["--max-lora-rank", "8", "--lora-modules"]
        flags += [f"{n}={p}" for n, p in zip(names, adapters, strict=True)]
    server = ServerProcess(*flags, api_server_count=1, cwd=tree)
    try:
        server.wait_healthy()
        wait_for_writes()
        choices = zipf_choices(args.requests, len(adapters))
        models = [names[c] if cpu_loras is not None else None for c in choices]
        asyncio.run(_load(server.url, models[:4], data["prompts"], 4, 4))  # warm-up
        before = lifecycle_counts(server.url) if cpu_loras is not None else {}
        ttfts, produced, seconds = asyncio.run(
            _load(server.url, models, data["prompts"], args.tokens, args.concurrency)
        )
        after = lifecycle_counts(server.url) if cpu_loras is not None else {}
    finally:
        server.stop()
    per_minute = 60 / seconds

    def rate(*keys: tuple[str, str]) -> float:
        return sum(after.get(k, 0.0) - before.get(k, 0.0) for k in keys) * per_minute

    return {
        "run": label,
        "requests": len(models),
        "seconds": seconds,
        "tokens_per_s": produced / seconds,
        "ttft_p50_ms": percentile(ttfts, 50) * 1000,
        "ttft_p99_ms": percentile(ttfts, 99) * 1000,
        "distinct_adapters": len(set(choices)) if cpu_loras is not None else 0,
        "disk_loads_per_min": rate(("loaded", "")),
        "activations_per_min": rate(("activated", "")),
        "lru_evictions_per_min": rate(("evicted", "lru")),
        "capacity_evictions_per_min": rate(("evicted", "capacity")),
    }


def zipf_part(adapters: list[Path], args: argparse.Namespace, data: dict) -> list[dict[str, Any]]:
    rows = [
        zipf_run("base model", adapters, None, args, data),
        zipf_run("host tier = 4", adapters, 4, args, data),
        zipf_run(f"host tier = {len(adapters)}", adapters, len(adapters), args, data),
        # Not the configuration: what more device slots buy on the same load.
        zipf_run(f"host {len(adapters)}, 8 slots", adapters, len(adapters), args, data, slots=8),
    ]
    if args.baseline is not None:
        # The same adapter runs served by an earlier checkout, for before/after in one run.
        tree = Path(args.baseline).resolve()
        rows += [
            zipf_run("host tier = 4 (baseline)", adapters, 4, args, data, tree=tree),
            zipf_run(
                f"host tier = {len(adapters)} (baseline)",
                adapters,
                len(adapters),
                args,
                data,
                tree=tree,
            ),
        ]
    base = rows[0]["tokens_per_s"]
    print(
        f"\n{args.requests} requests, {args.concurrency} in flight, {args.tokens} tokens, "
        f"{len(adapters)} adapters (Zipf s=1), --max-loras 4 unless stated"
    )
    header = (
        f"{'run':<20}{'tok/s':>8}{'x base':>8}{'TTFT p50':>10}{'p99 ms':>8}"
        f"{'loads/min':>11}{'activ/min':>11}{'lru/min':>9}{'cap/min':>9}"
    )
    print(header)
    for row in rows:
        row["x_base"] = row["tokens_per_s"] / base
        print(
            f"{row['run']:<20}{row['tokens_per_s']:8.1f}{row['x_base']:8.2f}"
            f"{row['ttft_p50_ms']:10.0f}{row['ttft_p99_ms']:8.0f}"
            f"{row['disk_loads_per_min']:11.1f}{row['activations_per_min']:11.1f}"
            f"{row['lru_evictions_per_min']:9.1f}{row['capacity_evictions_per_min']:9.1f}"
        )
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4))
    labels = [r["run"] for r in rows]
    left.bar(labels, [r["tokens_per_s"] for r in rows], color="#4c72b0")
    left.set_ylabel("output tokens/s")
    left.set_title("Zipf over 20 adapters, 16 in flight: throughput")
    width = 0.38
    xs = range(len(rows))
    right.bar([x - width / 2 for x in xs], [r["ttft_p50_ms"] for r in rows], width, label="p50")
    right.bar([x + width / 2 for x in xs], [r["ttft_p99_ms"] for r in rows], width, label="p99")
    right.set_xticks(list(xs), labels)
    right.set_ylabel("time to first token, ms")
    right.set_title("TTFT")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--part", choices=("overhead", "zipf", "all"), default="all")
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per Zipf request")
    parser.add_argument("--out", default=str(RESULTS / "lora.json"))
    parser.add_argument(
        "--baseline",
        default=None,
        help="a checkout of an earlier rankcast (its kernels built): the Zipf adapter runs are "
        "repeated with its server, side by side",
    )
    args = parser.parse_args()
    os.environ.setdefault("RANKCAST_DISABLE_PROGRESS", "1")
    os.environ.setdefault("RANKCAST_LOG_LEVEL", "WARNING")
    from rankcast.model_files.source import resolve_model

    data = json.loads(WORKLOAD.read_text())
    chats = [[{"role": "user", "content": p}] for p in data["prompts"]]
    tokens = int(data["output_tokens"])
    count = 20 if args.part != "overhead" else 4
    adapters = make_adapters(resolve_model(None).model_dir, RESULTS / "adapters", count, 8)
    import torch

    from rankcast.platform import resolve_dtype

    machine = machine_info()
    dtype = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    print(f"{describe(machine)}; dtype auto = {dtype}\n")
    results: dict[str, Any] = {"machine": machine, "dtype": dtype}
    if args.part in ("overhead", "all"):
        results["overhead"] = overhead_part(adapters, chats, tokens)
    if args.part in ("zipf", "all"):
        results["zipf"] = zipf_part(adapters, args, data)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
    if "zipf" in results:
        plot(results["zipf"], out.with_suffix(".png"))


if __name__ == "__main__":
    main()
