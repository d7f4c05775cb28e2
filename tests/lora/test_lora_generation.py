"""Offline multi-LoRA generation: greedy output with an adapter equals transformers + peft, and a
mixed batch (three adapters and the base model) equals each alone, at TP=1 and TP=2 (mp)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rankcast import LoRARequest, SamplingParams
from rankcast.lora.peft_adapter import LoRAAdapterError
from tests.conftest import reference_greedy
from tests.lora.conftest import lora_llm

TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
PROMPTS = [[5, 17, 300, 42, 9], [1, 2, 3], [900, 800, 700, 600, 500, 400], [77, 78]]


def _requests(adapters: list[Path]) -> list[LoRARequest | None]:
    return [LoRARequest(p.name, str(p)) for p in adapters] + [None]


def _tokens(outputs: list) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def alone(tiny_llama_dir: Path, mixed_adapters: list[Path]) -> Iterator[list[list[int]]]:
    """Each prompt generated on its own with its adapter (TP=1): the reference for batches."""
    with lora_llm(tiny_llama_dir, max_loras=4) as llm:
        yield [
            _tokens(llm.generate([prompt], GREEDY, lora_request=request))[0]
            for prompt, request in zip(PROMPTS, _requests(mixed_adapters), strict=True)
        ]


def test_an_adapter_generates_what_transformers_and_peft_generate(
    tiny_llama_dir: Path, mixed_adapters: list[Path], alone: list[list[int]]
) -> None:
    want = reference_greedy(tiny_llama_dir, PROMPTS[0], TOKENS, mixed_adapters[0])
    assert alone[0] == want
    assert alone[0] != alone[3] or PROMPTS[0] != PROMPTS[3]


@pytest.mark.parametrize("tp", [1, 2])
def test_a_mixed_batch_equals_each_alone(
    tp: int, tiny_llama_dir: Path, mixed_adapters: list[Path], alone: list[list[int]]
) -> None:
    with lora_llm(tiny_llama_dir, max_loras=4, tensor_parallel_size=tp) as llm:
        got = _tokens(llm.generate(PROMPTS, GREEDY, lora_request=_requests(mixed_adapters)))
        assert got == alone
        assert [a.name for a in llm.list_loras()] == [p.name for p in mixed_adapters]


def test_a_bad_adapter_changes_nothing(
    tiny_llama_dir: Path, mixed_adapters: list[Path], tmp_path: Path
) -> None:
    with lora_llm(tiny_llama_dir, max_loras=4) as llm:
        llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("good", str(mixed_adapters[0])))
        with pytest.raises(LoRAAdapterError, match=r"adapter_config\.json: missing"):
            llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("bad", str(tmp_path)))
        assert [a.name for a in llm.list_loras()] == ["good"]
        with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
            llm.engine.add_request(PROMPTS[0], GREEDY, lora_name="nope")


def test_chunked_prefill_changes_no_adapter_output(
    tiny_llama_dir: Path, mixed_adapters: list[Path]
) -> None:
    """Prompts split across 16-token steps give what whole prompts give, adapter by adapter."""
    prompts = [[(7 * i + j) % 250 + 1 for j in range(n)] for i, n in enumerate((1, 16, 23, 61))]
    requests = _requests(mixed_adapters)
    outputs = []
    for options in ({"enable_chunked_prefill": False}, {"max_num_batched_tokens": 16}):
        with lora_llm(tiny_llama_dir, max_loras=3, max_num_seqs=8, **options) as llm:
            outputs.append(_tokens(llm.generate(prompts, GREEDY, lora_request=requests)))
    assert outputs[0] == outputs[1]


def test_adapters_taking_turns_on_one_slot_change_no_output(
    tiny_llama_dir: Path, mixed_adapters: list[Path], alone: list[list[int]]
) -> None:
    """One slot, three adapters and turns of 2 steps: requests are parked mid-answer and
    resumed from their kept KV blocks, and every answer is still what it is alone."""
    with lora_llm(tiny_llama_dir, max_loras=1, lora_turn_steps=2) as llm:
        got = _tokens(llm.generate(PROMPTS, GREEDY, lora_request=_requests(mixed_adapters)))
        scheduler = llm.engine.client.core.scheduler
        assert scheduler.num_parked >= 2, "the adapters never took turns"
        assert scheduler.num_preemptions == 0
    assert got == alone
