"""SmolLM3 against transformers, float32: a Llama block with grouped KV heads whose attention
skips RoPE on some layers (`no_rope_layers`, 1 where a layer rotates; by default every 4th
layer without). From an HF directory and from a GGUF file as llama.cpp writes it (Q and K
permuted, no key for the layers without RoPE: its loader takes every 4th); offline whole,
through the C++ decoder stack and the modules (the same bits); offline whole, chunked and with
prefix-cache hits, at PP=2, and served at TP=2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rankcast import LLM, SamplingParams
from rankcast.errors import ModelFormatError
from rankcast.model_files.arch import ArchConfig
from tests.model.family_models import (
    ENGINE,
    NEW_TOKENS,
    PROMPTS,
    assert_gguf_converts_to_the_checkpoint,
    assert_greedy_whole_chunked_and_cached,
    assert_logits_match_transformers,
    assert_peft_adapter_matches,
    assert_served_at_tp2,
    reference_greedy_all,
    stack_and_modules_logits,
    stack_expected,
    write_checkpoint,
    write_llama_cpp_gguf,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
# 5 layers: with the default interval of 4, layer 3 alone has no RoPE.
LAYERS = 5


@pytest.fixture(scope="module")
def smollm3_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_source: Path) -> Path:
    path = tmp_path_factory.mktemp("smollm3")
    return write_checkpoint(path, "smollm3", tokenizer_source, seed=11, num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def reference(smollm3_dir: Path) -> list[list[int]]:
    return reference_greedy_all(smollm3_dir, PROMPTS, NEW_TOKENS)


def test_config_names_the_layers_without_rope(smollm3_dir: Path) -> None:
    arch = ArchConfig.from_model_dir(smollm3_dir)
    assert arch.architecture == "SmolLM3ForCausalLM" and not arch.qk_norm
    assert arch.rope_layers == (True, True, True, False, True)
    assert arch.tie_word_embeddings and arch.rope_theta == 2e6
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (4, 2, 16)
    config = json.loads((smollm3_dir / "config.json").read_text())
    # Without the list, from the interval, as SmolLM3Config derives it.
    del config["no_rope_layers"]
    assert ArchConfig.from_dict(config).rope_layers == (True, True, True, False, True)
    config["no_rope_layer_interval"] = 2
    assert ArchConfig.from_dict(config).rope_layers == (True, False, True, False, True)


@pytest.mark.parametrize(
    "updates,message",
    [
        ({"no_rope_layers": [1, 1, 0]}, "no_rope_layers must list 0 or 1 for each of the 5"),
        ({"no_rope_layers": [1, 2, 1, 0, 1]}, "no_rope_layers must list 0 or 1"),
        ({"no_rope_layers": None, "no_rope_layer_interval": 0}, "no_rope_layer_interval"),
        ({"use_sliding_window": True, "sliding_window": 64}, "use_sliding_window"),
        ({"mlp_bias": True}, "mlp_bias"),
    ],
    ids=["short-list", "not-a-flag", "zero-interval", "sliding-window", "mlp-bias"],
)
def test_wrong_fields_are_refused_by_name(smollm3_dir: Path, updates: dict, message: str) -> None:
    config = json.loads((smollm3_dir / "config.json").read_text())
    config.update(updates)
    with pytest.raises(ModelFormatError, match=message):
        ArchConfig.from_dict(config)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-layers", "module-path"])
@pytest.mark.parametrize(
    "overrides",
    [{}, {"no_rope_layers": [0, 1, 0, 1, 1], "tie_word_embeddings": False}],
    ids=["every-4th-tied", "own-list-untied"],
)
def test_prefill_and_decode_logits_match_transformers(
    tmp_path: Path, tokenizer_source: Path, overrides: dict, fused: bool
) -> None:

    model_dir = write_checkpoint(
        tmp_path / "m", "smollm3", tokenizer_source, seed=12, num_hidden_layers=LAYERS, **overrides
    )
    assert_logits_match_transformers(model_dir, fused)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_decoder_stack_gives_the_modules_bits(smollm3_dir: Path, dtype: torch.dtype) -> None:
    """The C++ decoder stack runs the layers without RoPE with the modules' kernels, in order."""
    if not stack_expected(dtype):
        pytest.skip("the C++ decoder stack needs rankcast's packed linears on this machine")
    fused, modules = stack_and_modules_logits(smollm3_dir, dtype)
    assert torch.equal(fused, modules)


def test_greedy_whole_chunked_and_from_the_prefix_cache(
    smollm3_dir: Path, reference: list[list[int]]
) -> None:
    """32 greedy tokens equal transformers' with prompts whole, then in 16-token chunks with
    the prefix cache on: one at a time (the second prompt starts from the first's blocks), and
    all again (every full block a hit), the same tokens each time."""
    assert_greedy_whole_chunked_and_cached(smollm3_dir, reference)


def test_a_llama_cpp_gguf_served_at_tp2(
    smollm3_dir: Path,
    reference: list[list[int]],
    embedded_gguf: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The file llama.cpp's converter writes (`general.architecture` smollm3, Q and K permuted
    as for Llama, nothing naming the layers without RoPE) converts to the checkpoint's very
    tensors and its every-4th-layer pattern, and `rankcast serve` of it at TP=2 answers
    transformers' tokens."""
    monkeypatch.setenv("RANKCAST_CACHE_DIR", str(tmp_path / "cache"))
    gguf_path = write_llama_cpp_gguf(tmp_path / "smollm3-tiny.gguf", smollm3_dir, embedded_gguf)
    converted = assert_gguf_converts_to_the_checkpoint(gguf_path, smollm3_dir)
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["SmolLM3ForCausalLM"]
    assert ArchConfig.from_model_dir(converted).rope_layers == (True, True, True, False, True)
    assert_served_at_tp2(gguf_path, smollm3_dir, reference)


def test_pipeline_stages_keep_each_layers_rope_switch(
    smollm3_dir: Path, reference: list[list[int]]
) -> None:
    """At PP=2 the layer without RoPE (3 of 5) sits in the second stage, which must still know
    it by its index in the whole model."""
    with LLM(str(smollm3_dir), pipeline_parallel_size=2, **ENGINE) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == reference


def test_a_peft_adapter_on_every_projection(smollm3_dir: Path, tmp_path: Path) -> None:
    """A peft adapter for SmolLM3 (layers without RoPE included) generates transformers +
    peft's tokens at TP=1 and TP=2."""
    assert_peft_adapter_matches(
        smollm3_dir,
        tmp_path / "lora",
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        PROMPTS[0],
    )
