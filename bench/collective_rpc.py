"""Round-trip latency of an empty collective RPC against world size, mp and Ray executors.

Ray joins RANKCAST_RAY_ADDRESS / RAY_ADDRESS if set, else starts a local instance.

Each rank runs the tiny random-weight model the tests use (TP = world size), so start-up is
quick and the figure is the executor's own cost: encode, one send per rank, every rank's reply.

    python bench/collective_rpc.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def measure(model_dir: Path, backend: str, world: int, calls: int) -> dict[str, float]:
    from rankcast import LLM

    llm = LLM(
        str(model_dir),
        dtype="float32",
        tensor_parallel_size=world,
        distributed_executor_backend=backend,
        kv_cache_space_gib=0.02,
    )
    executor = llm.engine.client.core.executor
    for _ in range(50):
        executor.collective_rpc("rank_info")
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        executor.collective_rpc("rank_info")
        samples.append(time.perf_counter() - start)
    llm.shutdown()
    samples.sort()
    return {
        "backend": backend,
        "world_size": world,
        "p50_us": samples[len(samples) // 2] * 1e6,
        "p99_us": samples[int(len(samples) * 0.99)] * 1e6,
        "mean_us": sum(samples) / len(samples) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--skip-ray", action="store_true", help="measure the mp executor only")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "collective_rpc.json"))
    args = parser.parse_args()
    os.environ.setdefault("RANKCAST_DISABLE_PROGRESS", "1")
    os.environ.setdefault("RANKCAST_LOG_LEVEL", "WARNING")
    from rankcast.model_files.source import resolve_model
    from tests.conftest import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(
            Path(tmp) / "tiny", tokenizer_from=resolve_model(None).model_dir
        )
        rows = [measure(model_dir, "mp", world, args.calls) for world in (1, 2, 4)]
        if not args.skip_ray:
            rows += [measure(model_dir, "ray", world, args.calls) for world in (1, 2, 4)]
    print(f"\nempty collective_rpc round trip, {args.calls} calls\n")
    print(f"{'backend':>8}{'world':>6}{'p50 us':>10}{'p99 us':>10}{'mean us':>10}")
    for row in rows:
        print(
            f"{row['backend']:>8}{row['world_size']:>6}{row['p50_us']:>10.0f}{row['p99_us']:>10.0f}{row['mean_us']:>10.0f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"calls": args.calls, "rows": rows}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
