"""Offline throughput: rankcast `LLM` against transformers' batched `generate`, same weights.

Standard workload (../shared/bench/prompts.json): 32 chat prompts, chat template applied,
128 output tokens each with EOS ignored; greedy. Both engines run in this one process, one after
the other, on the weights of the embedded SmolLM2-135M-Instruct GGUF. Also measures cold start
(GGUF to first token, empty cache) and warm start (cached weights) in fresh subprocesses.

    python bench/offline_throughput.py [--quick] [--out bench/results/offline_throughput.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT.parent / "shared" / "bench" / "prompts.json"

START_SCRIPT = """
import time, sys
t0 = time.perf_counter()
from rankcast import LLM, SamplingParams
llm = LLM(kv_cache_space_gib=0.5)
llm.generate(["Hello"], SamplingParams(max_tokens=1))
print(time.perf_counter() - t0)
"""


def load_workload() -> tuple[list[list[dict[str, str]]], int]:
    data = json.loads(WORKLOAD.read_text())
    return [[{"role": "user", "content": p}] for p in data["prompts"]], int(data["output_tokens"])


def time_start(cache_dir: str | None) -> float:
    env = dict(os.environ, RANKCAST_DISABLE_PROGRESS="1", RANKCAST_LOG_LEVEL="WARNING")
    if cache_dir is not None:
        env["RANKCAST_CACHE_DIR"] = cache_dir
    out = subprocess.run(
        [sys.executable, "-c", START_SCRIPT], env=env, capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def bench_rankcast(dtype: str, chats, output_tokens: int) -> dict[str, float]:
    from rankcast import LLM, SamplingParams

    llm = LLM(dtype=dtype, kv_cache_space_gib=1.0)
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    llm.chat(chats[:4], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    start = time.perf_counter()
    outs = llm.chat(chats, params)
    batch_s = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    start = time.perf_counter()
    single = llm.chat(chats[:1], params)
    single_s = time.perf_counter() - start
    resolved = str(llm.engine.client.core.executor.worker.dtype).replace("torch.", "")
    llm.shutdown()
    return {
        "dtype": resolved,
        "batch_tokens_per_s": produced / batch_s,
        "single_tokens_per_s": len(single[0].outputs[0].token_ids) / single_s,
    }


def bench_transformers(dtype: str, chats, output_tokens: int, packed_gguf: bool) -> dict:
    """transformers' batched `generate` on the same weights.

    By default it loads the dequantized safetensors rankcast made from the GGUF (plain dense
    layers, the classic float32 path); with `packed_gguf` it loads the GGUF itself, which recent
    transformers keeps 4-bit packed with dequantizing kernels.
    """
    import transformers

    from rankcast.model.source import embedded_gguf_path, resolve_model

    gguf = embedded_gguf_path()
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.padding_side = "left"
    if packed_gguf:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, dtype)
        )
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(resolve_model(None).model_dir), dtype=getattr(torch, dtype)
        )
    model.eval()
    model.generation_config.eos_token_id = None  # like ignore_eos
    model.generation_config.pad_token_id = tok.pad_token_id

    def run(batch) -> tuple[int, float]:
        texts = [
            tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in batch
        ]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=output_tokens, do_sample=False)
        elapsed = time.perf_counter() - start
        return (out.shape[1] - enc.input_ids.shape[1]) * len(batch), elapsed

    run(chats[:2])  # warm-up
    produced, batch_s = run(chats)
    single, single_s = run(chats[:1])
    return {
        "dtype": dtype,
        "batch_tokens_per_s": produced / batch_s,
        "single_tokens_per_s": single / single_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--out", default=str(ROOT / "bench" / "results" / "offline_throughput.json")
    )
    parser.add_argument("--quick", action="store_true", help="8 prompts x 32 tokens (smoke run)")
    parser.add_argument("--skip-start", action="store_true", help="skip cold/warm start timing")
    args = parser.parse_args()
    os.environ.setdefault("RANKCAST_DISABLE_PROGRESS", "1")
    os.environ.setdefault("RANKCAST_LOG_LEVEL", "WARNING")
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    chats, output_tokens = load_workload()
    if args.quick:
        chats, output_tokens = chats[:8], 32

    results: dict[str, object] = {
        "workload": {"prompts": len(chats), "output_tokens": output_tokens, "ignore_eos": True},
        "machine": {"cpus": len(os.sched_getaffinity(0)), "processor": platform.processor()},
        "torch": torch.__version__,
    }
    rows: list[tuple[str, dict[str, float]]] = []
    rows.append(("rankcast (auto)", bench_rankcast("auto", chats, output_tokens)))
    rows.append(("rankcast float32", bench_rankcast("float32", chats, output_tokens)))
    for name, dtype, packed in (
        ("transformers float32", "float32", False),
        ("transformers bfloat16", "bfloat16", False),
        ("transformers GGUF-packed", "float32", True),
    ):
        rows.append((name, bench_transformers(dtype, chats, output_tokens, packed)))
    results["engines"] = {name: figures for name, figures in rows}
    baseline = dict(rows)["transformers float32"]

    print(f"\nworkload: {len(chats)} prompts x {output_tokens} tokens, greedy, ignore_eos\n")
    print(
        f"{'engine':<26}{'dtype':<10}{'batch tok/s':>12}{'x tf32':>8}"
        f"{'1-stream tok/s':>16}{'x tf32':>8}"
    )
    for name, f in rows:
        print(
            f"{name:<26}{f['dtype']:<10}{f['batch_tokens_per_s']:>12.1f}"
            f"{f['batch_tokens_per_s'] / baseline['batch_tokens_per_s']:>8.2f}"
            f"{f['single_tokens_per_s']:>16.1f}"
            f"{f['single_tokens_per_s'] / baseline['single_tokens_per_s']:>8.2f}"
        )
    if not args.skip_start:
        with tempfile.TemporaryDirectory() as empty_cache:
            cold = time_start(empty_cache)
            warm = time_start(empty_cache)
        results["start_seconds"] = {"cold_gguf_to_first_token": cold, "warm_cached": warm}
        print(
            f"\nstart: cold (GGUF to first token) {cold:.1f} s, warm (cached weights) {warm:.1f} s"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
