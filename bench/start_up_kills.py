"""Kills across a fleet's start: how long until it serves again, against a kill after start-up.

`rankcast serve` of the embedded SmolLM2 with 2 API servers (and `--tensor-parallel-size`, 1 by
default as an operator starts it; 3 adds a rank of its own to kill). For each moment of the
start (tests/reliability/start_up_kills.py: the engine core before its model loads, during the
KV commit, before it answers any hello; API server 1 during and after its handshake, with the
engine core or API server 1 itself killed there; a rank during its KV commit when ranks are
processes), `--runs` fresh fleets each: hold the start there, kill -9, and time until every API
server answers /health 200 from the engine's next incarnation and a completion is served. The
baseline rows kill the engine core, or API server 1, of a fleet that has started: the restart
time every start-up kill is held to. A fleet that does not serve within 30 s counts as hung
(there must be none).

No anchor column: other engines do not restart what died (vLLM's API server exits when its
engine core does), so there is no like-for-like figure; this measures rankcast against itself.

    python bench/start_up_kills.py [--runs 3] [--tensor-parallel-size 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.workload import describe, machine_info  # noqa: E402
from tests.entrypoints.server_process import ServerProcess  # noqa: E402
from tests.reliability.start_up_kills import (  # noqa: E402
    SERVE_AGAIN_S,
    Moment,
    arm,
    kill_at,
    moments,
    release_all,
    until_serving,
)

API_SERVERS = 2


def _fleet(tp: int, holds: Path) -> ServerProcess:
    return ServerProcess(
        "--tensor-parallel-size",
        str(tp),
        "--max-model-len",
        "1024",
        api_server_count=API_SERVERS,
        env={"RANKCAST_START_UP_HOLDS": str(holds)},
    )


def _trial(tp: int, moment: Moment) -> dict[str, Any]:
    """One fresh fleet, one kill at `moment`; its timings, or why it failed."""
    with tempfile.TemporaryDirectory() as holds:
        arm(Path(holds), moment)
        launched = time.monotonic()
        server = _fleet(tp, Path(holds))
        try:
            outcome = kill_at(server, Path(holds), moment, API_SERVERS, launched)
            return {"held_s": outcome.held_s, "serving_s": outcome.serving_s, "hung": False}
        except AssertionError as exc:
            return {"hung": True, "error": str(exc).splitlines()[0][:200]}
        finally:
            release_all(Path(holds))
            server.stop()


def _after_start_up(tp: int, role: str) -> dict[str, Any]:
    """The baseline: kill `role` of a fleet that has started; seconds until it serves again."""
    with tempfile.TemporaryDirectory() as holds:
        server = _fleet(tp, Path(holds))
        try:
            server.wait_healthy()
            os.kill(server.pid_of(role), signal.SIGKILL)
            killed = time.monotonic()
            incarnation = 0 if role.startswith("api_server") else 1
            until_serving(server.url, API_SERVERS, incarnation, SERVE_AGAIN_S)
            return {"serving_s": time.monotonic() - killed, "hung": False}
        except AssertionError as exc:
            return {"hung": True, "error": str(exc).splitlines()[0][:200]}
        finally:
            server.stop()


def _row(what: str, trials: list[dict[str, Any]]) -> dict[str, Any]:
    times = [t["serving_s"] for t in trials if not t["hung"]]
    return {
        "moment": what,
        "kills": len(trials),
        "hung": sum(t["hung"] for t in trials),
        "serving_s": {
            "min": min(times, default=None),
            "median": statistics.median(times) if times else None,
            "max": max(times, default=None),
        },
        "trials": trials,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="fleets per moment")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "start_up_kills.json"
    )
    args = parser.parse_args()
    tp = args.tensor_parallel_size
    machine = machine_info()
    plan = list(moments(rank_processes=tp > 1))
    rows = []
    for role, what in (("engine_core_dp0", "engine core, after start-up (baseline)"),
                       ("api_server_1", "API server 1, after start-up (baseline)")):  # fmt: skip
        rows.append(_row(what, [_after_start_up(tp, role) for _ in range(args.runs)]))
        print(f"{what}: done", flush=True)
    # Runs alternate between moments: one moment's runs back to back would share whatever
    # the machine was doing then.
    trials: dict[str, list[dict[str, Any]]] = {m.what: [] for m in plan}
    for run in range(args.runs):
        for moment in plan:
            trials[moment.what].append(_trial(tp, moment))
            print(f"run {run + 1}: {moment.name}: {trials[moment.what][-1]}", flush=True)
    rows += [_row(m.what, trials[m.what]) for m in plan]

    print(f"\nKills across the start of `rankcast serve` (TP={tp}, {API_SERVERS} API servers, "
          f"SmolLM2-135M) on {describe(machine)}")  # fmt: skip
    print(f"{'killed':<46} {'kills':>5} {'hung':>4}  serving again (s): min / median / max")
    for row in rows:
        t = row["serving_s"]
        spread = (
            f"{t['min']:.1f} / {t['median']:.1f} / {t['max']:.1f}"
            if t["median"] is not None
            else "-"
        )
        print(f"{row['moment']:<46} {row['kills']:>5} {row['hung']:>4}  {spread}")
    kills = sum(row["kills"] for row in rows[2:])
    hung = sum(row["hung"] for row in rows[2:])
    print(f"\n{kills} kills across the start, {hung} hung fleets")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"machine": machine, "tensor_parallel_size": tp, "runs": args.runs, "rows": rows},
            indent=2,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
