"""Gemma 3 (text, `Gemma3ForCausalLM`) against transformers, float32: five sliding-window layers
per global one (window 20 here, so the 40-token prompts and their 32 new tokens run past it), a
RoPE base of 10,000 on the local layers and a linearly scaled 1e6 on the global ones, q/k norms,
four norms a block each scaling by 1 + w, embeddings scaled by sqrt(hidden), GeGLU, the attention
scale of query_pre_attn_scalar. From an HF directory and from a GGUF file as llama.cpp writes it
(norms stored with the 1 added); offline whole, chunked and from the prefix cache, at PP=2, and
served at TP=2 by a Python and a Rust API server. Also Mistral's window, now attended as a
window (no longer a cap on the context)."""

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

WINDOW = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
# Gemma 3's RoPE as transformers 5 writes it: the global layers' (scaled, as the 4B and larger
# scale theirs), the local layers' own base.
ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_source: Path) -> Path:
    """Six layers in Gemma 3's pattern (0-4 local, 5 global), as llama.cpp's loader assumes
    it, so the same checkpoint also goes through GGUF."""
    return write_checkpoint(
        tmp_path_factory.mktemp("gemma3"),
        "gemma3",
        tokenizer_source,
        seed=3,
        num_hidden_layers=6,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=WINDOW,
        rope_parameters=ROPE,
    )


@pytest.fixture(scope="module")
def reference(gemma3_dir: Path) -> list[list[int]]:
    return reference_greedy_all(gemma3_dir, PROMPTS, NEW_TOKENS)


def test_config_names_what_the_decoder_needs(gemma3_dir: Path) -> None:
    arch = ArchConfig.from_model_dir(gemma3_dir)
    assert arch.architecture == "Gemma3ForCausalLM"
    assert arch.layer_windows == (WINDOW,) * 5 + (0,)
    assert arch.rope_theta == 1e6 and arch.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert arch.local_rope_theta == 1e4
    assert arch.qk_norm and arch.sandwich_norms and arch.norm_weight_offset == 1.0
    assert arch.embedding_multiplier == 8.0 and arch.hidden_activation == "gelu_tanh"
    assert arch.attention_scale == 32**-0.5 and arch.tie_word_embeddings
    # A config.json as the Hub's older Gemma 3 files have it: no layer_types (every 6th layer
    # global), rope_theta / rope_local_base_freq / rope_scaling at the top level.
    old = json.loads((gemma3_dir / "config.json").read_text())
    for key in ("layer_types", "rope_parameters"):
        del old[key]
    old.update(
        rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling=None, sliding_window_pattern=3
    )
    older = ArchConfig.from_dict(old)
    assert older.layer_windows == (WINDOW, WINDOW, 0, WINDOW, WINDOW, 0)
    assert older.rope_scaling is None and older.local_rope_theta == 1e4


@pytest.mark.parametrize(
    "updates,message",
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"hidden_activation": "relu"}, "hidden_activation 'relu'"),
        ({"layer_types": ["sliding_attention"] * 2}, "layer_types must name each of the 6"),
        ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be a positive number"),
        ({"sliding_window": -1}, "sliding_window must be a positive integer"),
        ({"final_logit_softcapping": "big"}, "final_logit_softcapping must be"),
    ],
    ids=["attn-softcap", "bidirectional", "activation", "layer-types", "scalar", "window", "cap"],
)
def test_wrong_fields_are_refused_by_name(gemma3_dir: Path, updates: dict, message: str) -> None:
    config = json.loads((gemma3_dir / "config.json").read_text())
    config.update(updates)
    with pytest.raises(ModelFormatError, match=message):
        ArchConfig.from_dict(config)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {
            "num_hidden_layers": 4,
            "layer_types": [
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "sliding_attention",
            ],
            "sliding_window": 8,
            "query_pre_attn_scalar": 24,
            "final_logit_softcapping": 3.0,
        },
    ],
    ids=["gguf-shaped", "window-8-soft-capped"],
)
def test_prefill_and_decode_logits_match_transformers(
    gemma3_dir: Path, tmp_path: Path, tokenizer_source: Path, overrides: dict
) -> None:
    """Prefill, then decode steps, in scattered blocks: within 1e-4 of transformers; also with a
    window shorter than a block, its own attention scale and soft-capped logits."""
    if overrides:
        gemma3_dir = write_checkpoint(
            tmp_path / "m",
            "gemma3",
            tokenizer_source,
            seed=4,
            head_dim=32,
            rope_parameters=ROPE,
            **overrides,
        )
    for fused in (True, False):
        assert_logits_match_transformers(gemma3_dir, fused=fused)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_decoder_stack_gives_the_modules_bits(gemma3_dir: Path, dtype: torch.dtype) -> None:
    """The C++ decoder stack runs Gemma 3's block (four norms scaling by 1 + w in float32 before
    rounding, GeGLU, the local layers' RoPE table and their own KV-cache group's blocks): one
    decode step's logits are the modules' very bits, in bfloat16 too, where rounding before or
    after the norm's scale would show."""
    if not stack_expected(dtype):
        pytest.skip("the C++ decoder stack needs rankcast's packed linears on this machine")
    fused, modules = stack_and_modules_logits(gemma3_dir, dtype, window_tables=[[5], [14, 2]])
    assert torch.equal(fused, modules)


def test_greedy_whole_chunked_and_from_the_prefix_cache(
    gemma3_dir: Path, reference: list[list[int]]
) -> None:
    """32 greedy tokens equal transformers' whole, in 16-token chunks and from the prefix cache:
    the windowed layers give a token the same bits however its prompt was cut."""
    assert_greedy_whole_chunked_and_cached(gemma3_dir, reference)


def test_a_peft_adapter_on_every_projection(gemma3_dir: Path, tmp_path: Path) -> None:
    """A peft adapter for Gemma 3 generates transformers + peft's tokens at TP=1 (its deltas
    added inside the C++ decoder stack, between the block's extra norms) and TP=2."""
    assert_peft_adapter_matches(
        gemma3_dir,
        tmp_path / "lora",
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        PROMPTS[0],
    )


def test_pipeline_stages_keep_each_layers_window_and_rope_table(
    gemma3_dir: Path, reference: list[list[int]]
) -> None:
    """At PP=2 the global layer (5) sits in the second stage with three local ones: each stage
    builds both RoPE tables and knows each of its layers' window by the layer's index."""
    with LLM(str(gemma3_dir), pipeline_parallel_size=2, **ENGINE) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == reference


def test_bfloat16_is_as_near_float32_as_transformers_own(gemma3_dir: Path) -> None:
    """In bfloat16 the norms keep their 1 + w in float32 and scale before rounding, as Gemma's
    reference does: a prompt's logits are no further from float32's than transformers' own
    bfloat16 model's are (its error measured on the same prompt, with some slack)."""
    import transformers

    from rankcast.model.loader import load_model
    from rankcast.protocol import ScheduledSequence, SchedulerOutput
    from rankcast.worker.model_runner import ModelRunner

    arch = ArchConfig.from_model_dir(gemma3_dir)
    ours, theirs = {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(gemma3_dir, arch, dtype, torch.device("cpu"))
        runner = ModelRunner(model, arch, 16, torch.device("cpu"), dtype)
        runner.initialize_cache(16)
        step = SchedulerOutput([ScheduledSequence("r", PROMPTS[0], 0, [3, 7, 1])])
        ours[dtype] = runner.compute_logits(step).float()[0]
        reference = transformers.AutoModelForCausalLM.from_pretrained(str(gemma3_dir), dtype=dtype)
        with torch.no_grad():
            theirs[dtype] = reference(torch.tensor([PROMPTS[0]])).logits[0, -1].float()
    assert torch.isfinite(ours[torch.bfloat16]).all()
    ours_error = (ours[torch.bfloat16] - theirs[torch.float32]).abs().max()
    their_error = (theirs[torch.bfloat16] - theirs[torch.float32]).abs().max()
    assert ours_error <= 1.5 * their_error, (float(ours_error), float(their_error))


def test_a_llama_cpp_gguf_served_at_tp2(
    gemma3_dir: Path,
    reference: list[list[int]],
    embedded_gguf: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The file llama.cpp's converter writes (`general.architecture` gemma3, `blk.N.ffn_norm`
    the norm before the MLP, `post_attention_norm` and `post_ffw_norm`, every norm weight with
    1 added, the window as `gemma3.attention.sliding_window`) converts to the checkpoint: the
    projections bit for bit, each norm's 1 + w as the model forms it; and `rankcast serve` of
    it at TP=2 answers transformers' tokens."""
    from safetensors.torch import load_file

    from rankcast.model_files.source import resolve_model

    monkeypatch.setenv("RANKCAST_CACHE_DIR", str(tmp_path / "cache"))
    gguf_path = write_llama_cpp_gguf(tmp_path / "gemma3.gguf", gemma3_dir, embedded_gguf)
    converted = resolve_model(str(gguf_path)).model_dir
    ours = load_file(str(converted / "model.safetensors"))
    theirs = load_file(str(gemma3_dir / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        if name.endswith("norm.weight"):
            assert torch.equal(ours[name] + 1.0, tensor + 1.0), name
        else:
            assert torch.equal(ours[name], tensor), name
    arch = ArchConfig.from_model_dir(converted)
    want = ArchConfig.from_model_dir(gemma3_dir)
    for field in (
        "layer_windows",
        "local_rope_theta",
        "rope_theta",
        "rope_scaling",
        "attention_scale",
        "embedding_multiplier",
        "sandwich_norms",
    ):
        assert getattr(arch, field) == getattr(want, field), field
    assert_served_at_tp2(gguf_path, converted, reference)


# ---- Mistral's window: attended as a window ----


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_source: Path) -> Path:
    return write_checkpoint(
        tmp_path_factory.mktemp("mistral"),
        "mistral",
        tokenizer_source,
        seed=5,
        num_hidden_layers=3,
        sliding_window=WINDOW,
    )


def test_a_mistral_window_is_attended_past_its_length(mistral_dir: Path) -> None:
    """Mistral with a 20-token window, prompts of 40 and 32 new tokens: every layer attends to
    the last 20 positions as transformers' mask does, through the C++ decoder stack where this
    machine builds it and through the modules, whole, chunked and from the prefix cache."""
    arch = ArchConfig.from_model_dir(mistral_dir)
    assert arch.layer_windows == (WINDOW,) * 3 and arch.max_position_embeddings == 512
    assert_logits_match_transformers(mistral_dir, fused=True)
    assert_logits_match_transformers(mistral_dir, fused=False)
    reference = reference_greedy_all(mistral_dir, PROMPTS, NEW_TOKENS)
    assert_greedy_whole_chunked_and_cached(mistral_dir, reference)
