"""LoRA cost on offline throughput, SmolLM2-135M, standard workload (32 prompts x 128 tokens).

Side by side, one process, one after another: the base model without LoRA; the base model with
LoRA enabled (no request uses an adapter); every request on one r=8 adapter; requests spread
over four r=8 adapters. Adapters are made here with `peft` (random, non-zero weights, all seven
projections). The Zipf / eviction part of issue 6 waits for the adapter cache.

    python bench/lora.py
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT.parent / "shared" / "bench" / "prompts.json"
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


def run(enable_lora: bool, adapters: list[Path], chats: list, tokens: int) -> dict[str, float]:
    from rankcast import LLM, LoRARequest, SamplingParams

    kwargs = {"enable_lora": True, "max_loras": 4, "max_lora_rank": 8} if enable_lora else {}
    llm = LLM(kv_cache_space_gib=0.5, **kwargs)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(RESULTS / "lora.json"))
    args = parser.parse_args()
    os.environ.setdefault("RANKCAST_DISABLE_PROGRESS", "1")
    os.environ.setdefault("RANKCAST_LOG_LEVEL", "WARNING")
    from rankcast.model.source import resolve_model

    data = json.loads(WORKLOAD.read_text())
    chats = [[{"role": "user", "content": p}] for p in data["prompts"]]
    tokens = int(data["output_tokens"])
    adapters = make_adapters(resolve_model(None).model_dir, RESULTS / "adapters", 4, 8)
    rows = []
    for name, enable, used in (
        ("base, LoRA off", False, []),
        ("base, LoRA on", True, []),
        ("1 adapter r=8", True, adapters[:1]),
        ("4 adapters r=8", True, adapters),
    ):
        row = {"run": name, **run(enable, used, chats, tokens)}
        rows.append(row)
    base = rows[0]["tokens_per_s"]
    print(f"{'run':<16} {'tok/s':>8} {'x base':>7}")
    for row in rows:
        row["x_base"] = row["tokens_per_s"] / base
        print(f"{row['run']:<16} {row['tokens_per_s']:8.1f} {row['x_base']:7.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
