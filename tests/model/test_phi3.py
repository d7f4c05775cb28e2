"""Phi-3 / Phi-4-mini (Phi3ForCausalLM) against transformers, float32: fused qkv_proj and
gate_up_proj split at load, partial rotary (0.75 and 0.5 of a head of 32), LongRoPE (short
factors within the original length, long ones beyond, and the attention factor), tied
embeddings. From an HF directory and from a GGUF file as llama.cpp writes it; through the C++
decoder stack and the modules (the same bits); offline whole, chunked and with prefix-cache
hits, and served at TP=2."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from rankcast.errors import ModelFormatError
from rankcast.model.rotary import RotaryEmbedding, partial_rotary_order
from rankcast.model_files.arch import ArchConfig
from tests.model.family_models import (
    NEW_TOKENS,
    PROMPTS,
    assert_gguf_converts_to_the_checkpoint,
    assert_greedy_whole_chunked_and_cached,
    assert_logits_match_transformers,
    assert_peft_adapter_matches,
    assert_served_at_tp2,
    stack_and_modules_logits,
    stack_expected,
    write_checkpoint,
    write_llama_cpp_gguf,
)

# A head of 32 (hidden 128, 4 heads, 2 KV heads), so 0.75 rotates 24 values and passes 8.
PHI3 = {"hidden_size": 128, "num_hidden_layers": 2, "partial_rotary_factor": 0.75}
# LongRoPE with an original context of 32: PROMPTS[0] (40 tokens) and every generation past it
# cross into the long factors; 512 / 32 gives an attention factor of sqrt(1 + ln 16 / ln 32).
ORIGINAL = 32


def _longrope(rotary_dim: int) -> dict:
    half = rotary_dim // 2
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.15 * i for i in range(half)],
        "long_factor": [1.5 + 0.9 * i for i in range(half)],
    }


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_source: Path) -> Path:
    """Plain RoPE over 24 of 32 values, tied embeddings (as Phi-4-mini)."""
    path = tmp_path_factory.mktemp("phi3")
    return write_checkpoint(
        path, "phi3", tokenizer_source, seed=11, tie_word_embeddings=True, **PHI3
    )


@pytest.fixture(scope="module")
def longrope_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_source: Path) -> Path:
    """LongRoPE over 16 of 32 values (0.5), its own LM head."""
    path = tmp_path_factory.mktemp("phi3-longrope")
    return write_checkpoint(
        path,
        "phi3",
        tokenizer_source,
        seed=12,
        **{**PHI3, "partial_rotary_factor": 0.5},
        original_max_position_embeddings=ORIGINAL,
        rope_parameters={**_longrope(16), "partial_rotary_factor": 0.5},
    )


def _cached_greedy(model_dir: Path, prompts: list[list[int]], split: int | None) -> list:
    """transformers' greedy tokens with its KV cache (how it generates: each call rotates by its
    own largest position, so a prompt within the original length keeps its short factors and
    each later token takes the long ones). A prompt longer than `split` is fed in two calls,
    the first `split` tokens then the rest."""
    import transformers
    from transformers import DynamicCache

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    out = []
    for prompt in prompts:
        cache = DynamicCache(config=model.config)
        whole = split is None or len(prompt) <= split
        pieces = [prompt] if whole else [prompt[:split], prompt[split:]]
        tokens: list[int] = []
        with torch.no_grad():
            for piece in pieces:
                logits = model(torch.tensor([piece]), cache=cache).logits
            for _ in range(NEW_TOKENS):
                tokens.append(int(logits[0, -1].argmax()))
                logits = model(torch.tensor([tokens[-1:]]), cache=cache).logits
        out.append(tokens)
    return out


@pytest.fixture(scope="module")
def reference(phi3_dir: Path) -> list[list[int]]:
    return _cached_greedy(phi3_dir, PROMPTS, None)


def test_config_names_what_the_decoder_needs(phi3_dir: Path, longrope_dir: Path) -> None:
    arch = ArchConfig.from_model_dir(phi3_dir)
    assert arch.architecture == "Phi3ForCausalLM"
    assert arch.head_dim == 32 and arch.rotary_dim == 24 and arch.tie_word_embeddings
    assert arch.rope_scaling is None and not arch.attention_bias
    long = ArchConfig.from_model_dir(longrope_dir)
    assert long.rotary_dim == 16 and long.rope_scaling is not None
    scaling = long.rope_scaling
    assert scaling["original_max_position_embeddings"] == ORIGINAL
    assert scaling["attention_factor"] == math.sqrt(1 + math.log(512 / 32) / math.log(32))
    # Phi-4-mini's config.json: the factor at the top level, the old "type" key, a window
    # beyond the context (no window); Phi-3-mini-4k's window below it windows every layer.
    sparse = {
        "architectures": ["Phi3ForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 2,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "partial_rotary_factor": 0.75,
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "sliding_window": 262144,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0] * 48,
            "long_factor": [2.0] * 48,
        },
    }
    phi4 = ArchConfig.from_dict(sparse)
    assert phi4.rotary_dim == 96 and phi4.max_position_embeddings == 131072
    assert phi4.layer_windows == ()
    assert phi4.rms_norm_eps == 1e-5  # Phi3Config's default
    mini_4k = ArchConfig.from_dict({**sparse, "rope_scaling": None, "sliding_window": 2047})
    assert mini_4k.max_position_embeddings == 131072 and mini_4k.rope_scaling is None
    assert mini_4k.layer_windows == (2047, 2047)


def test_the_rope_table_is_transformers_rotation_reordered() -> None:
    """Row p of the table, applied by the kernels' pairing to a head stored in
    `partial_rotary_order`, is transformers' partial rotation of that head, bit for bit; the
    passed-through values untouched; LongRoPE's short rows below the original length and
    long rows from it on."""
    import transformers
    from transformers.models.phi3 import modeling_phi3

    head_dim, rotary_dim = 32, 24
    config = transformers.Phi3Config(
        hidden_size=128,
        num_attention_heads=4,
        max_position_embeddings=512,
        original_max_position_embeddings=ORIGINAL,
        partial_rotary_factor=0.75,
        rope_parameters={**_longrope(rotary_dim), "partial_rotary_factor": 0.75},
    )
    theirs = modeling_phi3.Phi3RotaryEmbedding(config)
    arch_rope = ArchConfig.from_dict(
        {**config.to_dict(), "architectures": ["Phi3ForCausalLM"]}
    ).rope_scaling
    ours = RotaryEmbedding(head_dim, 512, 10000.0, arch_rope, rotary_dim)
    order = partial_rotary_order(head_dim, rotary_dim)
    x = torch.randn(1, 1, 3, head_dim)
    half = head_dim // 2
    for positions in ([0, 5, 31], [32, 100, 511]):  # each call within one regime
        cos, sin = theirs(x, torch.tensor([positions]))
        want, _ = modeling_phi3.apply_rotary_pos_emb(x, x, cos, sin)
        table = ours.cos_sin[positions]
        stored = x[0, 0][:, order]
        x1, x2 = stored[:, :half], stored[:, half:]
        c, s = table[:, :half], table[:, half:]
        got = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        torch.testing.assert_close(got, want[0, 0][:, order], atol=1e-6, rtol=0)
        assert torch.equal(got[:, 12:16], stored[:, 12:16])  # passed through exactly
        assert torch.equal(got[:, 28:], stored[:, 28:])


@pytest.mark.parametrize(
    "updates,message",
    [
        ({"partial_rotary_factor": 0.3}, "partial_rotary_factor 0.3 rotates 9"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
        (
            {"rope_parameters": {**_longrope(16), "short_factor": [1.0, 2.0]}},
            r"rope_scaling\.short_factor must list",
        ),
        (
            {"rope_parameters": {k: v for k, v in _longrope(24).items() if k != "long_factor"}},
            r"rope_scaling\.long_factor",
        ),
        ({"original_max_position_embeddings": "4k", "rope_scaling": _longrope(24)}, "original"),
        ({"sliding_window": 0}, "sliding_window must be a positive integer"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"num_hidden_layers": None}, "num_hidden_layers"),
    ],
    ids=[
        "odd-rotary",
        "dynamic-rope",
        "short-factors",
        "no-long-factors",
        "original-length",
        "window",
        "activation",
        "layers",
    ],
)
def test_wrong_or_missing_fields_are_refused_by_name(
    phi3_dir: Path, updates: dict, message: str
) -> None:
    config = json.loads((phi3_dir / "config.json").read_text())
    config.update(updates)
    if config.get("num_hidden_layers", 0) is None:
        del config["num_hidden_layers"]
    if "partial_rotary_factor" in updates:
        config["rope_parameters"].pop("partial_rotary_factor", None)
    with pytest.raises(ModelFormatError, match=message):
        ArchConfig.from_dict(config)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-layers", "module-path"])
@pytest.mark.parametrize("which", ["partial-0.75", "longrope-0.5"])
def test_prefill_and_decode_logits_match_transformers(
    phi3_dir: Path, longrope_dir: Path, tmp_path: Path, which: str, fused: bool
) -> None:
    """Prefill and five decode steps (the 40-token prompt at positions past the original 32:
    transformers, given the whole sequence at each step, takes the long factors for all of it;
    the 5-token one stays short) to 1e-4."""
    model_dir = phi3_dir
    if which == "longrope-0.5":
        # Compared where both sides take the short factors throughout (an original length of
        # 64): transformers re-reads the whole sequence at each step here, which past the
        # original length would rotate the early positions with the long factors too (the
        # greedy test below holds the long regime to transformers' cached generation).
        model_dir = tmp_path / "longrope-64"
        shutil.copytree(longrope_dir, model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        config["original_max_position_embeddings"] = 64
        config["rope_parameters"]["original_max_position_embeddings"] = 64
        (model_dir / "config.json").write_text(json.dumps(config))
        scaling = ArchConfig.from_model_dir(model_dir).rope_scaling
        assert scaling is not None and scaling["attention_factor"] > 1.0
    assert_logits_match_transformers(model_dir, fused)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_decoder_stack_gives_the_modules_bits(longrope_dir: Path, dtype: torch.dtype) -> None:
    """The stack takes the partial, LongRoPE table as it is: the modules' very bits."""
    if not stack_expected(dtype):
        pytest.skip("the C++ decoder stack needs rankcast's packed linears on this machine")
    fused, modules = stack_and_modules_logits(longrope_dir, dtype)
    assert torch.equal(fused, modules)


def test_greedy_whole_chunked_and_from_the_prefix_cache(
    phi3_dir: Path, reference: list[list[int]]
) -> None:
    """32 greedy tokens equal transformers' with prompts whole, then in 16-token chunks with
    the prefix cache on, the same tokens each time."""
    assert_greedy_whole_chunked_and_cached(phi3_dir, reference)


def test_longrope_greedy_crosses_into_the_long_factors(longrope_dir: Path) -> None:
    """LongRoPE by position: the 5-token and 36-token prompts' generations run past the
    original 32 positions, each token from 32 on taking the long factors, as transformers'
    cached generation does; the 40-token prompt equals transformers fed it in two calls at the
    boundary (rankcast's documented choice: positions within the original length keep the
    short factors whatever the prompt's length). Whole, chunked and from the prefix cache."""
    reference = _cached_greedy(longrope_dir, PROMPTS, ORIGINAL)
    assert_greedy_whole_chunked_and_cached(longrope_dir, reference)


def test_a_llama_cpp_gguf_served_at_tp2(
    longrope_dir: Path,
    embedded_gguf: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The file llama.cpp's converter writes (fused `attn_qkv`, `ffn_up` holding gate and up,
    `phi3.rope.dimension_count`, LongRoPE as `rope_factors_short` / `rope_factors_long` with the
    original context and attention factor in metadata) converts to the checkpoint's tensors and
    RoPE parameters, and `rankcast serve` of it at TP=2 (each rank cutting its heads from the
    split q, k and v, and its columns from gate and up) answers transformers' tokens."""
    monkeypatch.setenv("RANKCAST_CACHE_DIR", str(tmp_path / "cache"))
    gguf_path = write_llama_cpp_gguf(tmp_path / "phi3-tiny.gguf", longrope_dir, embedded_gguf)
    converted = assert_gguf_converts_to_the_checkpoint(gguf_path, longrope_dir)
    from_gguf = ArchConfig.from_model_dir(converted)
    from_hf = ArchConfig.from_model_dir(longrope_dir)
    assert from_gguf.rotary_dim == from_hf.rotary_dim == 16
    assert from_gguf.rope_scaling is not None and from_hf.rope_scaling is not None
    # Stored as float32 by llama.cpp: the values transformers' float32 arithmetic takes.
    for key in ("short_factor", "long_factor", "attention_factor"):
        got, want = from_gguf.rope_scaling[key], from_hf.rope_scaling[key]
        assert torch.equal(torch.tensor(got), torch.tensor(want)), key
    assert_served_at_tp2(gguf_path, longrope_dir, _cached_greedy(longrope_dir, PROMPTS, ORIGINAL))


def test_a_fused_projection_of_the_wrong_size_is_refused_naming_it(
    phi3_dir: Path, tmp_path: Path
) -> None:
    """A qkv_proj whose rows are not the config's heads (here: a config claiming 4 KV heads
    for a checkpoint of 2) is refused naming the tensor and what it should hold."""
    from rankcast.model.loader import load_model

    broken = tmp_path / "wrong-heads"
    shutil.copytree(phi3_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    config["num_key_value_heads"] = 4
    (broken / "config.json").write_text(json.dumps(config))
    arch = ArchConfig.from_model_dir(broken)
    with pytest.raises(ModelFormatError, match=r"layers\.0\.self_attn\.qkv_proj\.weight: 256 rows"):
        load_model(broken, arch, torch.float32, torch.device("cpu"))


def test_pipeline_stages_and_a_quantized_gguf(
    longrope_dir: Path, embedded_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At PP=2 each stage builds its own table and reorders its own layers' heads: transformers'
    tokens. A file whose projections llama-quantize made Q8_0 (the fused attn_qkv and ffn_up
    among them) is served with its own weights (`native_quantization`), rows split and reordered
    within whole quantization blocks."""
    from rankcast import LLM, SamplingParams
    from rankcast.model_files.gguf_convert import native_quantization

    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine = {"dtype": "float32", "kv_cache_space_gib": 0.05}
    reference = _cached_greedy(longrope_dir, PROMPTS, ORIGINAL)
    with LLM(str(longrope_dir), pipeline_parallel_size=2, **engine) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)] == reference
    monkeypatch.setenv("RANKCAST_CACHE_DIR", str(tmp_path / "cache"))
    path = write_llama_cpp_gguf(tmp_path / "q8.gguf", longrope_dir, embedded_gguf, "Q8_0")
    assert native_quantization(path) == "q8_0"
    with LLM(str(path), quantization="auto", **engine) as llm:
        outputs = llm.generate(PROMPTS, greedy)
    assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in outputs)


def test_a_peft_adapter_on_the_fused_projections(phi3_dir: Path, tmp_path: Path) -> None:
    """An adapter peft makes for Phi-3 targets its fused qkv_proj and gate_up_proj: read as
    the parts (B's rows split, q and k rows in the model's head order), it generates what
    transformers with peft generates, at TP=1 and TP=2."""
    assert_peft_adapter_matches(
        phi3_dir,
        tmp_path / "phi3-lora",
        ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
        PROMPTS[0],
    )
