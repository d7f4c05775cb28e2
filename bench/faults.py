"""Faults under load: kill -9 one process of a serving fleet and count what happens.

`rankcast serve` of the embedded SmolLM2 with TP=3 ranks and 2 API servers, 8 clients streaming
completions back to back (64 tokens each, greedy). For each role (the engine core, one rank, one
API server), in a fresh server: 3 s of load, SIGKILL, load until every API server serves again
plus 3 s. Per role:

- detect: seconds from the kill until the fleet shows it (engine core or rank: every API server
  answers /health 503; API server: the launcher has started its replacement);
- serve again: seconds from the kill until every API server answers /health 200 again;
- completed: requests that finished; refused: answered 503 at once while the fleet was down
  (the clients send again straight away, so an outage refuses many); failed: requests in flight
  that ended with an error the client saw (an error event, or a connection closed before
  `[DONE]`);
- lost: requests with neither within 60 s of the kill (must be 0).

No anchor column: this times rankcast's own recovery (restart, reconnect), which has no
like-for-like figure in an engine that does not restart what died; the throughput benchmarks
carry the vLLM-cpu ratios.

    python bench/faults.py [--roles engine_core_dp0,worker_dp0_pp0_tp1,api_server_1]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.workload import describe, load_prompts, machine_info  # noqa: E402
from tests.entrypoints.server_process import ServerProcess  # noqa: E402

API_SERVERS = 2
CLIENTS = 8
LOST_AFTER_S = 60.0


@dataclass
class Outcomes:
    completed: int = 0
    refused: int = 0
    failed: int = 0
    lost: int = 0
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, detail: str = "") -> None:
        with self.lock:
            setattr(self, kind, getattr(self, kind) + 1)
            if detail and len(self.failures) < 5:
                self.failures.append(detail)


def _one_request(url: str, prompt: str, outcomes: Outcomes) -> None:
    body = {"prompt": prompt, "max_tokens": 64, "temperature": 0, "stream": True}
    try:
        with (
            httpx.Client(timeout=httpx.Timeout(10, read=LOST_AFTER_S)) as http,
            http.stream("POST", f"{url}/v1/completions", json=body) as response,
        ):
            if response.status_code != 200:
                outcomes.add("refused")
                return
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    except httpx.ReadTimeout:
        outcomes.add("lost", "no byte for 60 s")
        return
    except httpx.HTTPError as exc:
        outcomes.add("failed", type(exc).__name__)
        return
    if not events or events[-1] != "[DONE]":
        outcomes.add("failed", "closed before [DONE]")
    elif any('"error"' in e for e in events):
        outcomes.add("failed", "error event")
    else:
        outcomes.add("completed")


def _all_health(url: str, status: int) -> set[str]:
    """API servers seen answering /health with `status` in a quick round of connections."""
    seen: set[str] = set()
    for _ in range(8):
        try:
            with httpx.Client(timeout=2) as http:
                response = http.get(f"{url}/health")
        except httpx.HTTPError:
            continue
        if response.status_code == status:
            seen.add(response.headers["x-rankcast-api-server"])
    return seen


def run_role(role: str, prompts: list[str]) -> dict[str, Any]:
    server = ServerProcess(
        "--tensor-parallel-size",
        "3",
        "--max-model-len",
        "512",
        "--kv-cache-space",
        "0.5",
        api_server_count=API_SERVERS,
    )
    outcomes = Outcomes()
    stop = threading.Event()

    def client(i: int) -> None:
        n = i
        while not stop.is_set():
            _one_request(server.url, prompts[n % len(prompts)], outcomes)
            n += CLIENTS

    with server.running():
        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(CLIENTS)]
        for thread in threads:
            thread.start()
        time.sleep(3)
        victim = server.pid_of(role)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        detect = again = None
        while time.monotonic() - killed < 120:
            if detect is None:
                if role.startswith("api_server"):
                    with contextlib.suppress(LookupError):
                        if server.pid_of(role) != victim:
                            detect = time.monotonic() - killed
                elif len(_all_health(server.url, 503)) == API_SERVERS:
                    detect = time.monotonic() - killed
            elif len(_all_health(server.url, 200)) == API_SERVERS:
                again = time.monotonic() - killed
                break
            time.sleep(0.05)
        time.sleep(3)
        stop.set()
        for thread in threads:
            thread.join(LOST_AFTER_S + 15)
    return {
        "role": role,
        "detect_s": detect,
        "serve_again_s": again,
        "completed": outcomes.completed,
        "refused": outcomes.refused,
        "failed": outcomes.failed,
        "lost": outcomes.lost,
        "failures": outcomes.failures,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    def secs(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    print(
        f"\n{'role killed':<22}{'detect s':>10}{'serve again s':>15}{'completed':>11}"
        f"{'refused':>9}{'failed':>8}{'lost':>6}"
    )
    for row in rows:
        print(
            f"{row['role']:<22}{secs(row['detect_s']):>10}{secs(row['serve_again_s']):>15}"
            f"{row['completed']:>11}{row['refused']:>9}{row['failed']:>8}{row['lost']:>6}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--roles", default="engine_core_dp0,worker_dp0_pp0_tp1,api_server_1")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "faults.json"))
    args = parser.parse_args()
    machine = machine_info()
    print(f"Machine: {describe(machine)}")
    print(f"SmolLM2 TP=3, {API_SERVERS} API servers, {CLIENTS} clients streaming 64 tokens")
    prompts, _ = load_prompts()
    rows = []
    for role in args.roles.split(","):
        rows.append(run_role(role, prompts))
        print_table(rows[-1:])
    print_table(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "roles": rows}, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
