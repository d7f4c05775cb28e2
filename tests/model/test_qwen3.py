"""Qwen3 (dense) against transformers, float32: a per-head RMSNorm on q and k before RoPE, a
head_dim (32) that is not hidden / heads (16), tied embeddings. From an HF directory and from a
GGUF file as llama.cpp writes it; through the C++ decoder stack and the modules (the same bits);
offline whole, chunked and with prefix-cache hits, and served at TP=2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from rankcast import SamplingParams
from rankcast.errors import ModelFormatError
from rankcast.model.loader import load_model
from rankcast.model_files.arch import ArchConfig
from tests.model.family_models import (
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


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_source: Path) -> Path:
    path = tmp_path_factory.mktemp("qwen3")
    return write_checkpoint(
        path,
        "qwen3",
        tokenizer_source,
        seed=7,
        num_hidden_layers=3,
        head_dim=32,
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="module")
def reference(qwen3_dir: Path) -> list[list[int]]:
    return reference_greedy_all(qwen3_dir, PROMPTS, NEW_TOKENS)


def test_config_names_what_the_decoder_needs(qwen3_dir: Path) -> None:
    arch = ArchConfig.from_model_dir(qwen3_dir)
    assert arch.architecture == "Qwen3ForCausalLM"
    assert arch.qk_norm and arch.head_dim == 32 and arch.tie_word_embeddings
    assert not arch.attention_bias and not arch.output_bias
    assert arch.rope_layers == (True, True, True)
    # As Qwen3Config fills a config that leaves it out: 128 wide, whatever hidden / heads.
    sparse = json.loads((qwen3_dir / "config.json").read_text())
    del sparse["head_dim"]
    assert ArchConfig.from_dict(sparse).head_dim == 128


@pytest.mark.parametrize(
    "updates,removed,message",
    [
        (
            {"use_sliding_window": True, "layer_types": ["sliding_attention"]},
            (),
            "layer_types must name each of the 3",
        ),
        ({}, ("num_attention_heads",), "'num_attention_heads' is missing"),
    ],
    ids=["layer-types", "missing-heads"],
)
def test_wrong_or_missing_fields_are_refused_by_name(
    qwen3_dir: Path, updates: dict, removed: tuple[str, ...], message: str
) -> None:
    config = json.loads((qwen3_dir / "config.json").read_text())
    config.update(updates)
    for key in removed:
        del config[key]
    with pytest.raises(ModelFormatError, match=message):
        ArchConfig.from_dict(config)


def test_a_checkpoint_without_its_qk_norms_is_refused_naming_them(
    qwen3_dir: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "no-norms"
    shutil.copytree(qwen3_dir, broken)
    weights = load_file(str(broken / "model.safetensors"))
    kept = {k: v for k, v in weights.items() if not k.endswith("k_norm.weight")}
    save_file(kept, str(broken / "model.safetensors"), metadata={"format": "pt"})
    arch = ArchConfig.from_model_dir(broken)
    with pytest.raises(ModelFormatError, match=r"lacks 3 tensors: layers\.0\.self_attn\.k_norm"):
        load_model(broken, arch, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("fused", [True, False], ids=["fused-layers", "module-path"])
@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_word_embeddings": False, "attention_bias": True}],
    ids=["tied", "own-head-with-biases"],
)
def test_prefill_and_decode_logits_match_transformers(
    qwen3_dir: Path, tmp_path: Path, tokenizer_source: Path, overrides: dict, fused: bool
) -> None:
    """Prefill and decode steps against transformers, also with Qwen3's q, k, v and o biases."""

    if overrides:
        qwen3_dir = write_checkpoint(
            tmp_path / "m", "qwen3", tokenizer_source, seed=8, num_hidden_layers=2, **overrides
        )
    arch = ArchConfig.from_model_dir(qwen3_dir)
    assert arch.output_bias == bool(overrides)
    assert_logits_match_transformers(qwen3_dir, fused)


def test_use_sliding_window_windows_the_layers_from_max_window_layers(
    tmp_path: Path, tokenizer_source: Path
) -> None:
    """Qwen3Config's window applies with use_sliding_window, to the layers from
    max_window_layers on: those attend 20 positions back, the first one the whole context, as
    transformers' model does, through the C++ decoder stack and the modules."""
    windowed = write_checkpoint(
        tmp_path / "m",
        "qwen3",
        tokenizer_source,
        seed=9,
        num_hidden_layers=3,
        head_dim=32,
        use_sliding_window=True,
        sliding_window=20,
        max_window_layers=1,
    )
    assert ArchConfig.from_model_dir(windowed).layer_windows == (0, 20, 20)
    for fused in (True, False):
        assert_logits_match_transformers(windowed, fused)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_decoder_stack_gives_the_modules_bits(qwen3_dir: Path, dtype: torch.dtype) -> None:
    """The C++ decoder stack runs the q/k norms with the modules' kernels, in their order."""
    if not stack_expected(dtype):
        pytest.skip("the C++ decoder stack needs rankcast's packed linears on this machine")
    fused, modules = stack_and_modules_logits(qwen3_dir, dtype)
    assert torch.equal(fused, modules)


def test_greedy_whole_chunked_and_from_the_prefix_cache(
    qwen3_dir: Path, reference: list[list[int]]
) -> None:
    """32 greedy tokens equal transformers' with prompts whole, then in 16-token chunks with
    the prefix cache on: one at a time (the second prompt starts from the first's blocks), and
    all again (every full block a hit), the same tokens each time."""
    assert_greedy_whole_chunked_and_cached(qwen3_dir, reference)


def test_a_llama_cpp_gguf_served_at_tp2(
    qwen3_dir: Path,
    reference: list[list[int]],
    embedded_gguf: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The file llama.cpp's converter writes (`qwen3.attention.key_length` for head_dim,
    `blk.N.attn_q_norm` / `attn_k_norm`, Q and K as stored) converts to the checkpoint's very
    tensors, and `rankcast serve` of it at TP=2 (each rank normalising its own heads) answers
    transformers' tokens."""
    monkeypatch.setenv("RANKCAST_CACHE_DIR", str(tmp_path / "cache"))
    gguf_path = write_llama_cpp_gguf(tmp_path / "qwen3-tiny.gguf", qwen3_dir, embedded_gguf)
    converted = assert_gguf_converts_to_the_checkpoint(gguf_path, qwen3_dir)
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] == 32
    assert_served_at_tp2(gguf_path, qwen3_dir, reference)


def test_a_peft_adapter_on_every_projection(qwen3_dir: Path, tmp_path: Path) -> None:
    """A peft adapter for Qwen3 generates transformers + peft's tokens at TP=1 and TP=2 (its
    q/k norms apply after the adapter's delta, as peft's wrapped q_proj and k_proj give)."""
    assert_peft_adapter_matches(
        qwen3_dir,
        tmp_path / "lora",
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        PROMPTS[0],
    )
