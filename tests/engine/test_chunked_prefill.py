"""Chunked prefill changes when prompt tokens are computed, never what is generated: greedy
output is token-identical with prompts split across steps and taken whole, in float32, at TP=1,
TP=3 and PP=2 (with LoRA adapters: tests/lora/test_lora_generation.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rankcast import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# Lengths around the 16-token budget and block boundaries: 1, one block, several chunks.
TINY_PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(n)] for i, n in enumerate((1, 16, 23, 61))]


def _tokens(outputs: list) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _generate(llm: LLM, prompts: list) -> list[list[int]]:
    with llm:
        return _tokens(llm.generate(prompts, GREEDY))


def test_tiny_model_chunked_equals_whole(tiny_llama_dir: Path) -> None:
    options = dict(dtype="float32", kv_cache_space_gib=0.05, max_num_seqs=8)
    whole = _generate(
        LLM(str(tiny_llama_dir), enable_chunked_prefill=False, **options), TINY_PROMPTS
    )
    chunked = _generate(
        LLM(str(tiny_llama_dir), max_num_batched_tokens=16, **options), TINY_PROMPTS
    )
    assert chunked == whole


@pytest.fixture(scope="module")
def smollm_prompts() -> list[str]:
    return [
        "Explain in two sentences why the sky is blue, and what sunsets have to do with it.",
        "Write a haiku about autumn.",
        "List three prime numbers.",
    ]


@pytest.fixture(scope="module")
def smollm_whole(smollm_prompts: list[str]) -> list[list[int]]:
    llm = LLM(dtype="float32", kv_cache_space_gib=0.25, enable_chunked_prefill=False)
    return _generate(llm, smollm_prompts)


@pytest.mark.parametrize("tp,pp", [(3, 1), (1, 2)], ids=["tp3", "pp2"])
def test_smollm2_chunked_across_ranks_equals_whole(
    smollm_prompts: list[str], smollm_whole: list[list[int]], tp: int, pp: int
) -> None:
    llm = LLM(
        dtype="float32",
        kv_cache_space_gib=0.25,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        max_num_batched_tokens=32,
        max_num_seqs=8,
    )
    assert _generate(llm, smollm_prompts) == smollm_whole
