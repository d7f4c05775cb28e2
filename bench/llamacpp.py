"""llama.cpp, the CPU anchor, run side by side with rankcast in the same benchmark run.

On CPUs people usually pick llama.cpp (or Ollama, built on it): it serves GGUF files with
quantized weights, so a single stream reads 2-4x fewer bytes per token than a bfloat16 model.
The benchmarks measure it on the same machine in the same run, per weight type, and print
rankcast's figures as ratios to its best type.

The anchor lives outside this repository in `$LLAMA_CPP_DIR` (default
`~/.cache/rankcast-llamacpp`): `bin/llama-batched-bench`, `bin/llama-server`, and the embedded
SmolLM2-135M-Instruct as `models/smol-{Q4_1,Q8_0,BF16,F32}.gguf` (the shipped Q4_1 file and the
same weights requantized), built natively for the CPU. `models()` derives `smol-Q4_K_M.gguf`
beside them with the anchor's `llama-quantize` on first use: the kind of GGUF most downloaded
(llama.cpp's K-quant mix; on SmolLM2, whose rows are 576 wide, mostly Q5_0 with Q4_K, Q6_K and
Q8_0 tensors), which rankcast also serves in the same run. Where the CPU reports `amx_int8`,
llama.cpp's AMX int8 kernels have died with an illegal instruction on the quantized files, so
those run with `--no-repack` (its AVX-512 kernels, what a user there ends up running), and every
result says so. Without the anchor the benchmarks say so and report rankcast's figures only.

Offline figures are `llama-batched-bench`'s generation rate (S_TG: decode only, prompt
excluded, like rankcast's decode-dominated figures); served ones are tokens/s at the client.

    python bench/llamacpp.py        # where the anchor is, and its offline figures
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

WEIGHT_TYPES = ("Q4_1", "Q8_0", "BF16", "F32", "Q4_K_M")
QUANTIZED = frozenset({"Q4_1", "Q8_0", "Q4_K_M"})
# Weight types derived here from the F32 file when missing (the anchor's install makes the others).
DERIVED = ("Q4_K_M",)
PROMPT_TOKENS = 40  # the standard workload's prompts, chat template applied: ~40 tokens
PARALLEL = (1, 32)


def llamacpp_dir() -> Path:
    return Path(os.environ.get("LLAMA_CPP_DIR", Path.home() / ".cache" / "rankcast-llamacpp"))


def binary(name: str) -> Path | None:
    path = llamacpp_dir() / "bin" / name
    return path if path.is_file() and os.access(path, os.X_OK) else None


def models() -> dict[str, Path]:
    """The GGUF file of each weight type present, in WEIGHT_TYPES order; the DERIVED types are
    made from the F32 file first where the anchor has `llama-quantize` and they are missing."""
    folder = llamacpp_dir() / "models"
    found = {t: folder / f"smol-{t}.gguf" for t in WEIGHT_TYPES}
    quantize, source = binary("llama-quantize"), found["F32"]
    for weight_type in DERIVED:
        if not found[weight_type].is_file() and quantize is not None and source.is_file():
            _derive(quantize, source, found[weight_type], weight_type)
    return {t: path for t, path in found.items() if path.is_file()}


def _derive(quantize: Path, source: Path, target: Path, weight_type: str) -> None:
    """`llama-quantize source target weight_type`, written under a temporary name first so an
    interrupted run leaves no half file behind."""
    partial = target.with_suffix(".partial")
    command = [str(quantize), str(source), str(partial), weight_type, str(threads())]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode == 0 and partial.is_file():
        partial.rename(target)
    else:
        partial.unlink(missing_ok=True)
        print(f"llama-quantize {weight_type} failed (exit {done.returncode}); no {target.name}")


def missing_message(tool: str = "llama-batched-bench") -> str | None:
    """Why the anchor cannot run `tool` here, or None when it can."""
    where = llamacpp_dir()
    if binary(tool) is None:
        return (
            f"no llama.cpp anchor in {where} (no bin/{tool}; set LLAMA_CPP_DIR to its "
            "directory): no llama.cpp figures or ratios"
        )
    if not models():
        return f"no llama.cpp models in {where / 'models'} (smol-*.gguf): no llama.cpp figures"
    return None


def threads() -> int:
    """Every core this process may run on (2 on the reference machine: `-t 2`)."""
    return len(os.sched_getaffinity(0))


def no_repack(weight_type: str) -> bool:
    """Whether `weight_type` runs with `--no-repack` here: quantized files where the CPU
    reports AMX int8 (llama.cpp's AMX kernels died with SIGILL there)."""
    from rankcast.model.linear_kernels import cpu_flags

    return weight_type in QUANTIZED and "amx_int8" in cpu_flags()


def label(weight_type: str) -> str:
    """The anchor's name in a table, with the flag that changed its kernels."""
    return f"llama.cpp {weight_type}" + (" (--no-repack)" if no_repack(weight_type) else "")


def _parse_jsonl(text: str) -> dict[int, dict[str, Any]]:
    rows = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            row = json.loads(line)
            rows[int(row["pl"])] = row
    return rows


def run_batched_bench(
    weight_type: str,
    prompt_tokens: int = PROMPT_TOKENS,
    output_tokens: int = 128,
    parallel: tuple[int, ...] = PARALLEL,
    timeout_s: float = 600.0,
    model: Path | None = None,
) -> dict[int, dict[str, Any]]:
    """One `llama-batched-bench` run on `weight_type` (the anchor's SmolLM2 file of that type,
    or `model`): each parallel count's row (pp, tg, pl, t_tg, speed_tg = generation tok/s,
    ...), keyed by the count."""
    bench = binary("llama-batched-bench")
    model = models().get(weight_type) if model is None else model
    if bench is None or model is None:
        raise FileNotFoundError(missing_message() or f"no smol-{weight_type}.gguf")
    context = max(8192, max(parallel) * (prompt_tokens + output_tokens) + 256)
    command = [str(bench), "-m", str(model), "-t", str(threads()), "-c", str(context)]
    command += ["-b", "2048", "-ub", "512", "-npp", str(prompt_tokens)]
    command += ["-ntg", str(output_tokens), "-npl", ",".join(map(str, parallel))]
    command += ["--output-format", "jsonl"]
    if no_repack(weight_type):
        command.append("--no-repack")
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    rows = _parse_jsonl(done.stdout + "\n" + done.stderr)
    if done.returncode != 0 or set(rows) != set(parallel):
        tail = (done.stderr or done.stdout)[-1500:]
        raise RuntimeError(f"llama-batched-bench {weight_type} failed ({done.returncode}): {tail}")
    return rows


def run_offline(
    runs: int = 1,
    output_tokens: int = 128,
    prompt_tokens: int = PROMPT_TOKENS,
    batch: int = 32,
    weight_types: tuple[str, ...] | None = None,
) -> dict[str, dict[str, Any]]:
    """Batch (`batch` sequences) and single-stream generation tok/s of each weight type present
    (the median of `runs` runs of `llama-batched-bench`), keyed by weight type; a type that
    failed carries its "error" instead."""
    results: dict[str, dict[str, Any]] = {}
    for weight_type in weight_types or tuple(models()):
        print(f"running llama.cpp ({label(weight_type)}) ...", flush=True)
        try:
            tries = [
                run_batched_bench(weight_type, prompt_tokens, output_tokens, (1, batch))
                for _ in range(runs)
            ]
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as error:
            print(f"  llama.cpp {weight_type} failed: {error}", flush=True)
            results[weight_type] = {"weight_type": weight_type, "error": str(error)}
            continue
        results[weight_type] = {
            "weight_type": weight_type,
            "model": str(models()[weight_type]),
            "model_bytes": models()[weight_type].stat().st_size,
            "no_repack": no_repack(weight_type),
            "threads": threads(),
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "batch_tokens_per_s": statistics.median(t[batch]["speed_tg"] for t in tries),
            "single_tokens_per_s": statistics.median(t[1]["speed_tg"] for t in tries),
            "batch_runs": [t[batch]["speed_tg"] for t in tries],
            "single_runs": [t[1]["speed_tg"] for t in tries],
        }
    return results


def best(results: dict[str, dict[str, Any]], key: str) -> tuple[str, float] | None:
    """The weight type with the highest `key` figure, and that figure."""
    figures = [(t, r[key]) for t, r in results.items() if key in r]
    return max(figures, key=lambda item: item[1], default=None)


def spec_types() -> tuple[str, ...]:
    """The `--spec-type` values the installed `llama-server --help` lists (they change between
    llama.cpp versions), in its order; empty without the binary or the option."""
    server = binary("llama-server")
    if server is None:
        return ()
    done = subprocess.run(
        [str(server), "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    for line in (done.stdout + done.stderr).splitlines():
        words = line.split()
        if len(words) > 1 and words[0] == "--spec-type":
            return tuple(words[1].split(","))
    return ()


class LlamaServer:
    """`llama-server` (OpenAI API; any model name is accepted) on one weight type's file, in a
    session of its own so that `stop()` (also on leaving a `with` block) leaves nothing behind;
    `extra` flags go after the ones set here."""

    def __init__(
        self,
        weight_type: str,
        port: int,
        parallel: int = 32,
        context: int = 16384,
        log: Path | None = None,
        extra: Sequence[str] = (),
    ) -> None:
        server = binary("llama-server")
        model = models().get(weight_type)
        if server is None or model is None:
            raise FileNotFoundError(missing_message("llama-server") or f"no {weight_type} file")
        self.weight_type = weight_type
        self.no_repack = no_repack(weight_type)
        self.url = f"http://127.0.0.1:{port}"
        command = [str(server), "-m", str(model), "-t", str(threads()), "-np", str(parallel)]
        command += ["-c", str(context), "--host", "127.0.0.1", "--port", str(port)]
        if self.no_repack:
            command.append("--no-repack")
        command += extra
        self.command = command
        self.started = time.perf_counter()
        self.start_seconds = float("nan")
        with open(log, "w") if log is not None else contextlib.nullcontext(None) as sink:
            self.process = subprocess.Popen(
                command,
                stdout=sink if sink is not None else subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def wait_ready(self, timeout_s: float = 120.0) -> float:
        """Wait until /health answers 200 (503 while the model loads); returns seconds from
        launch to ready. Stops the server if it does not get there by the deadline."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code = self.process.returncode
                self.stop()
                raise RuntimeError(f"llama-server {self.weight_type} exited with {code}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        self.start_seconds = time.perf_counter() - self.started
                        return self.start_seconds
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"llama-server {self.weight_type} not ready in {timeout_s:.0f} s")

    def stop(self) -> None:
        """SIGTERM its session, then SIGKILL it if still there after 15 s (llama-server starts
        no children; the group is signalled only while its leader is not yet reaped)."""
        if self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def main() -> None:
    problem = missing_message()
    if problem is not None:
        print(problem)
        return
    print(f"llama.cpp anchor in {llamacpp_dir()}: {', '.join(models())}; -t {threads()}")
    for weight_type, row in run_offline().items():
        if "error" in row:
            continue
        print(
            f"{label(weight_type):<32}batch 32 {row['batch_tokens_per_s']:8.1f} tok/s   "
            f"1 stream {row['single_tokens_per_s']:7.1f} tok/s"
        )


if __name__ == "__main__":
    main()
