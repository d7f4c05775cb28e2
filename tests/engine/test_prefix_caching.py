"""Automatic prefix caching changes how much is computed, never what is generated."""

from __future__ import annotations

from pathlib import Path

import pytest

from rankcast import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SYSTEM = [(11 * j) % 240 + 3 for j in range(45)]  # a shared "system prompt" of 45 tokens
PROMPTS = [[*SYSTEM, i + 1, 2 * i + 5, 7] for i in range(5)] + [SYSTEM[:20], SYSTEM]


def _stats(llm: LLM):
    return llm.engine.client.core.scheduler.stats()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_outputs_are_identical_with_caching_on_and_off(tiny_llama_dir: Path, dtype: str) -> None:
    outputs = []
    for caching in (False, True):
        with LLM(
            str(tiny_llama_dir),
            dtype=dtype,
            kv_cache_space_gib=0.05,
            enable_prefix_caching=caching,
            max_num_batched_tokens=32,
            max_num_seqs=8,
        ) as llm:
            # One at a time, so every prompt after the first finds the shared prefix cached.
            outputs.append([llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS])
            stats = _stats(llm)
            if caching:
                assert stats.prefix_cache_hits >= 4 * 32, "later prompts reuse the system blocks"
                assert stats.prefix_cache_queries == sum(len(p) for p in PROMPTS)
            else:
                assert stats.prefix_cache_hits == 0
    assert outputs[0] == outputs[1]
