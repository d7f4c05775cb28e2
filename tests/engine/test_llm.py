"""The offline `LLM` on the embedded model: answers, batching, preemption, sampling, stops."""

from __future__ import annotations

import pytest

from rankcast import LLM, SamplingParams

BATCH_PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "The largest planet in the solar system is",
    "def add(a, b):",
    "My favourite fruit is",
    "The quick brown fox",
    "In 1492, Christopher Columbus",
    "A haiku about the sea:",
    "The speed of light is",
    "Photosynthesis is the process",
    "Dear team, I am writing to",
    "The best way to learn a language is",
    "import numpy as np\n",
    "Mount Everest is located in",
    "Shakespeare wrote",
    "To make a cup of tea, first",
]


@pytest.mark.parametrize("quantization", ["none", "auto"])
def test_default_model_answers_paris(quantization: str) -> None:
    """What `make serve` does: the embedded model, default precision, a chat question; with
    `--quantization auto` (what `make serve` passes) its own 4-bit layers and Q8_0 head."""
    with LLM(kv_cache_space_gib=0.25, quantization=quantization) as llm:
        out = llm.chat(
            [{"role": "user", "content": "What is the capital of France?"}],
            SamplingParams(temperature=0.0, max_tokens=32),
        )[0]
        model = llm.engine.client.core.executor.worker.runner.model
        head = model.lm_head.packed_weight
        layer = model.layers["0"].mlp.down_proj.packed_weight
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"
    if quantization == "auto" and head is not None:  # packed where the kernels are built
        assert (layer.quantization, head.quantization) == ("q4_1", "q8_0")


GREEDY_32 = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(smollm_fp32: LLM) -> list[list[int]]:
    """Each batch prompt's greedy tokens, generated alone (the batch tests' reference; made
    once: 16 single-stream runs are most of those tests' time)."""
    return [smollm_fp32.generate([p], GREEDY_32)[0].outputs[0].token_ids for p in BATCH_PROMPTS]


def test_batch_equals_each_prompt_alone(smollm_fp32: LLM, alone: list[list[int]]) -> None:
    batched = smollm_fp32.generate(BATCH_PROMPTS, GREEDY_32)
    assert len(batched) == 16
    for prompt, out, want in zip(BATCH_PROMPTS, batched, alone, strict=True):
        assert out.outputs[0].token_ids == want, prompt
        assert out.prompt == prompt


def test_batch_equals_alone_under_preemption(alone: list[list[int]]) -> None:
    """A KV budget far below the batch's needs forces recompute preemption; tokens stay (the
    same as each prompt alone on an engine with room to spare)."""
    with LLM(dtype="float32", num_blocks=24, block_size=16, max_model_len=256) as llm:
        core = llm.engine.client.core
        before = core.scheduler.num_preemptions
        batched = llm.generate(BATCH_PROMPTS, GREEDY_32)
        assert core.scheduler.num_preemptions > before, "the budget should have forced preemption"
    assert [o.outputs[0].token_ids for o in batched] == alone


def test_seeded_sampling_is_reproducible_and_seed_dependent(smollm_fp32: LLM) -> None:
    prompt = ["Tell me a story about a dragon."]

    def run(seed: int, batch_with_others: bool = False) -> list[int]:
        params = SamplingParams(
            temperature=1.0, top_p=0.95, max_tokens=32, seed=seed, ignore_eos=True
        )
        prompts = prompt + (BATCH_PROMPTS[:5] if batch_with_others else [])
        others = [SamplingParams(temperature=1.0, max_tokens=8)] * (len(prompts) - 1)
        return smollm_fp32.generate(prompts, [params, *others])[0].outputs[0].token_ids

    first = run(7)
    assert run(7) == first
    assert run(7, batch_with_others=True) == first, "a seeded request must not depend on its batch"
    assert run(8) != first


def test_sampling_filters_restrict_choices(smollm_fp32: LLM) -> None:
    greedy = smollm_fp32.generate(
        ["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=12)
    )[0]
    top1 = smollm_fp32.generate(
        ["The capital of France is"],
        SamplingParams(temperature=1.5, top_k=1, max_tokens=12, seed=3),
    )[0]
    assert top1.outputs[0].token_ids == greedy.outputs[0].token_ids
    tiny_p = smollm_fp32.generate(
        ["The capital of France is"],
        SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=12, seed=4),
    )[0]
    assert tiny_p.outputs[0].token_ids == greedy.outputs[0].token_ids
    high_min_p = smollm_fp32.generate(
        ["The capital of France is"],
        SamplingParams(temperature=1.5, min_p=0.999, max_tokens=12, seed=5),
    )[0]
    assert high_min_p.outputs[0].token_ids == greedy.outputs[0].token_ids


def test_max_tokens_stop_strings_and_stop_token_ids(smollm_fp32: LLM) -> None:
    prompt = ["Count from one to twenty: one, two, three,"]
    free = smollm_fp32.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30))[0]
    text = free.outputs[0].text
    assert "six" in text
    out = smollm_fp32.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5))[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"
    stopped = smollm_fp32.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=30, stop=["six"])
    )[0]
    assert stopped.outputs[0].text == text[: text.index("six")]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == "six"
    kept = smollm_fp32.generate(
        prompt,
        SamplingParams(
            temperature=0.0, max_tokens=30, stop=["six"], include_stop_str_in_output=True
        ),
    )[0]
    assert kept.outputs[0].text == text[: text.index("six") + 3]
    stop_id = free.outputs[0].token_ids[3]
    by_id = smollm_fp32.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_id])
    )[0]
    first = free.outputs[0].token_ids.index(stop_id)
    assert by_id.outputs[0].token_ids == free.outputs[0].token_ids[: first + 1]
    assert by_id.outputs[0].stop_reason == stop_id


def test_eos_stops_unless_ignored(smollm_fp32: LLM) -> None:
    chat = [{"role": "user", "content": "Say hello."}]
    ended = smollm_fp32.chat(chat, SamplingParams(temperature=0.0, max_tokens=200))[0]
    assert ended.outputs[0].finish_reason == "stop"
    assert len(ended.outputs[0].token_ids) < 200
    forced = smollm_fp32.chat(
        chat, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    )[0]
    assert len(forced.outputs[0].token_ids) == 60


def test_top_logprobs(smollm_fp32: LLM) -> None:
    out = smollm_fp32.generate(
        ["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3)
    )[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 4
    for token_id, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token_id in entry and entry[token_id].rank == 1  # greedy picks the top token
        assert len(entry) == 3
        values = sorted((lp.logprob for lp in entry.values()), reverse=True)
        assert all(v <= 0 for v in values) and entry[token_id].logprob == values[0]


def test_prompt_too_long_is_a_clear_error(smollm_fp32: LLM) -> None:
    limit = smollm_fp32.engine.max_model_len
    with pytest.raises(ValueError, match="maximum context length"):
        smollm_fp32.generate([[1] * limit], SamplingParams(max_tokens=1))
    # The engine keeps serving afterwards.
    assert smollm_fp32.generate(["Hi"], SamplingParams(max_tokens=2))[0].finished


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_p=2), "min_p"),
        (dict(logprobs=100), "logprobs"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
