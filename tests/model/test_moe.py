"""Mixtures of experts against transformers, float32: Qwen3-MoE (Qwen3's attention; a router's
top-2 of 8 experts, renormalised; one layer left dense by `mlp_only_layers`) and Mixtral
(Mistral's attention; top-2 of 4). From HF directories; offline whole, chunked and with
prefix-cache hits (the batch-invariance rule: a token's experts' outputs are summed in one order
whatever else is in the batch), and Qwen3-MoE served at TP=2 (every rank a slice of every
expert)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from rankcast.errors import ModelFormatError
from rankcast.model.loader import load_model
from rankcast.model.moe import SparseMoeBlock
from rankcast.model_files.arch import ArchConfig
from tests.model.family_models import (
    NEW_TOKENS,
    PROMPTS,
    assert_greedy_whole_chunked_and_cached,
    assert_logits_match_transformers,
    assert_served_at_tp2,
    reference_greedy_all,
    write_checkpoint,
)


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_source: Path) -> Path:
    return write_checkpoint(
        tmp_path_factory.mktemp("qwen3_moe"),
        "qwen3_moe",
        tokenizer_source,
        seed=11,
        num_hidden_layers=3,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_source: Path) -> Path:
    return write_checkpoint(
        tmp_path_factory.mktemp("mixtral"),
        "mixtral",
        tokenizer_source,
        seed=12,
        num_hidden_layers=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=48,
    )


@pytest.fixture(scope="module")
def qwen3_moe_reference(qwen3_moe_dir: Path) -> list[list[int]]:
    return reference_greedy_all(qwen3_moe_dir, PROMPTS, NEW_TOKENS)


def test_configs_name_the_experts_and_the_dense_layers(
    qwen3_moe_dir: Path, mixtral_dir: Path
) -> None:
    qwen = ArchConfig.from_model_dir(qwen3_moe_dir)
    assert qwen.architecture == "Qwen3MoeForCausalLM" and qwen.qk_norm
    assert qwen.moe_layers == (True, False, True)
    assert (qwen.num_experts, qwen.experts_per_token, qwen.expert_intermediate_size) == (8, 2, 32)
    assert qwen.norm_topk_prob
    mixtral = ArchConfig.from_model_dir(mixtral_dir)
    assert mixtral.architecture == "MixtralForCausalLM" and not mixtral.qk_norm
    assert mixtral.moe_layers == (True, True) and mixtral.num_experts == 4
    assert mixtral.expert_intermediate_size == 48 and mixtral.norm_topk_prob
    model = load_model(qwen3_moe_dir, qwen, torch.float32, torch.device("cpu"))
    kinds = [type(layer.mlp).__name__ for layer in model.decoder_layers()]
    assert kinds == ["SparseMoeBlock", "LlamaMLP", "SparseMoeBlock"]
    assert not model.fuse_layers()  # the C++ stack runs dense MLPs only


def test_bad_expert_fields_are_refused_naming_them(qwen3_moe_dir: Path) -> None:
    config = json.loads((qwen3_moe_dir / "config.json").read_text())
    for change, named in (
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
        ({"moe_intermediate_size": None}, "moe_intermediate_size"),
        ({"mlp_only_layers": [7]}, "mlp_only_layers"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ):
        with pytest.raises(ModelFormatError, match=named):
            ArchConfig.from_dict({**config, **change})


@pytest.mark.parametrize("name", ["qwen3_moe_dir", "mixtral_dir"])
def test_logits_match_transformers(name: str, request: pytest.FixtureRequest) -> None:
    assert_logits_match_transformers(request.getfixturevalue(name), fused=False)


def test_greedy_whole_chunked_and_cached(
    qwen3_moe_dir: Path, qwen3_moe_reference: list[list[int]]
) -> None:
    assert_greedy_whole_chunked_and_cached(qwen3_moe_dir, qwen3_moe_reference)


def test_mixtral_greedy_whole_chunked_and_cached(mixtral_dir: Path) -> None:
    assert_greedy_whole_chunked_and_cached(
        mixtral_dir, reference_greedy_all(mixtral_dir, PROMPTS, NEW_TOKENS)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_output_does_not_depend_on_who_shares_its_experts(
    qwen3_moe_dir: Path, dtype: torch.dtype
) -> None:
    """The block on one token alone, and on it among others that choose the same experts and
    others: the same bits, on the kernels this CPU runs the dtype on."""
    arch = ArchConfig.from_model_dir(qwen3_moe_dir)
    model = load_model(qwen3_moe_dir, arch, dtype, torch.device("cpu"))
    block = model.decoder_layers()[0].mlp
    assert isinstance(block, SparseMoeBlock)
    torch.manual_seed(0)
    tokens = torch.randn(33, arch.hidden_size).to(dtype)
    together = block(tokens)
    for i in (0, 7, 32):
        torch.testing.assert_close(block(tokens[i : i + 1]), together[i : i + 1], rtol=0, atol=0)
    chosen, _ = block.route(tokens)
    assert len(torch.unique(chosen)) > 2  # the batch spreads over several experts


def test_served_at_tp2(
    qwen3_moe_dir: Path, tokenizer_source: Path, qwen3_moe_reference: list[list[int]]
) -> None:
    assert_served_at_tp2(qwen3_moe_dir, tokenizer_source, qwen3_moe_reference)


def test_an_adapter_on_the_experts_is_refused_naming_the_tensor(
    qwen3_moe_dir: Path, tmp_path: Path
) -> None:
    """Adapters reach the attention projections of every layer and the MLP of dense layers;
    one that adapts an expert is refused at load, naming its tensor, not served without it."""
    from safetensors.torch import save_file

    from rankcast.lora.peft_adapter import LoRAAdapterError, inspect_peft_adapter

    arch = ArchConfig.from_model_dir(qwen3_moe_dir)
    prefix = "base_model.model.model.layers"
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "bias": "none"}

    def adapter(name: str, tensors: dict[str, torch.Tensor]) -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / "adapter_config.json").write_text(json.dumps(config))
        save_file(tensors, str(path / "adapter_model.safetensors"))
        return path

    hidden, q = arch.hidden_size, arch.num_attention_heads * arch.head_dim
    attention_and_dense = adapter(
        "fine",
        {
            f"{prefix}.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, hidden),
            f"{prefix}.0.self_attn.q_proj.lora_B.weight": torch.zeros(q, 2),
            f"{prefix}.1.mlp.gate_proj.lora_A.weight": torch.zeros(2, hidden),
            f"{prefix}.1.mlp.gate_proj.lora_B.weight": torch.zeros(arch.intermediate_size, 2),
        },
    )
    assert len(inspect_peft_adapter(attention_and_dense, arch, 8).keys) == 4
    expert = f"{prefix}.0.mlp.experts.3.gate_proj.lora_A.weight"
    on_an_expert = adapter(
        "experts",
        {
            expert: torch.zeros(2, hidden),
            expert.replace("lora_A", "lora_B"): torch.zeros(arch.expert_intermediate_size, 2),
        },
    )
    with pytest.raises(LoRAAdapterError, match="mixture of experts") as refused:
        inspect_peft_adapter(on_an_expert, arch, 8)
    assert "experts.3.gate_proj" in str(refused.value)


def test_a_llama_cpp_qwen3moe_gguf_converts_and_generates_transformers_tokens(
    tmp_path: Path, tokenizer_source: Path, embedded_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file llama.cpp's converter writes of a Qwen3-MoE (every layer sparse, as llama.cpp
    makes them; the router `ffn_gate_inp` float32; each projection's experts stacked in one
    `ffn_*_exps` tensor) converts to the checkpoint's very tensors, and generates transformers'
    tokens; stored Q8_0, it is served as its own Q8_0 (`--quantization auto`), router kept
    float."""
    from rankcast import LLM, SamplingParams
    from rankcast.model.layers import ReplicatedLinear, layer_quantization
    from rankcast.model_files.gguf_convert import native_quantization
    from tests.model.family_models import (
        assert_gguf_converts_to_the_checkpoint,
        write_llama_cpp_gguf,
    )

    monkeypatch.setenv("RANKCAST_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = write_checkpoint(
        tmp_path / "m",
        "qwen3_moe",
        tokenizer_source,
        seed=13,
        num_hidden_layers=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
    )
    gguf_path = write_llama_cpp_gguf(tmp_path / "moe.gguf", model_dir, embedded_gguf)
    converted = assert_gguf_converts_to_the_checkpoint(gguf_path, model_dir)
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_experts"] == 4
    want = reference_greedy_all(model_dir, PROMPTS[:1], 16)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(str(gguf_path), dtype="float32", kv_cache_space_gib=0.05) as llm:
        assert [llm.generate(PROMPTS[:1], greedy)[0].outputs[0].token_ids] == want

    quantized = write_llama_cpp_gguf(
        tmp_path / "moe-q8.gguf", model_dir, embedded_gguf, projections="Q8_0"
    )
    assert native_quantization(quantized) == "q8_0"
    assert layer_quantization(ReplicatedLinear(4, 2), "q8_0") == "none"
    with LLM(str(quantized), quantization="auto", kv_cache_space_gib=0.05) as llm:
        out = llm.generate(PROMPTS[:1], greedy)[0].outputs[0].token_ids
    assert len(out) == 16


def test_expert_parallel_ranks_hold_whole_experts_and_answer_transformers_tokens(
    qwen3_moe_dir: Path, qwen3_moe_reference: list[list[int]]
) -> None:
    """--enable-expert-parallel at TP=2: each rank holds 4 of the 8 experts whole (attention
    still split by heads), and the answers are transformers' tokens."""
    from rankcast import LLM, SamplingParams
    from rankcast.distributed import TensorParallelGroup

    arch = ArchConfig.from_model_dir(qwen3_moe_dir)
    shares = []
    for rank in range(2):
        block = SparseMoeBlock(arch, TensorParallelGroup(rank=rank, size=2), expert_parallel=True)
        shares.append(sorted(int(name) for name in block.experts))
        whole = block.experts[str(shares[-1][0])].gate_up_proj.weight.shape
        assert whole == (2 * arch.expert_intermediate_size, arch.hidden_size)
    assert shares == [[0, 1, 2, 3], [4, 5, 6, 7]]
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(
        str(qwen3_moe_dir),
        dtype="float32",
        kv_cache_space_gib=0.05,
        tensor_parallel_size=2,
        enable_expert_parallel=True,
        worker_extension_cls=f"{__name__}:ExpertsHeld",
    ) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
        held = llm.collective_rpc("experts_held")
    assert got == qwen3_moe_reference
    # Each rank's MoE layers (0 and 2) hold its share.
    assert held == [[[0, 1, 2, 3]] * 2, [[4, 5, 6, 7]] * 2]


class ExpertsHeld:
    """Mixed into each rank: the experts its MoE layers hold."""

    runner: Any

    def experts_held(self) -> list[list[int]]:
        return [
            sorted(int(name) for name in layer.mlp.experts)
            for layer in self.runner.model.decoder_layers()
            if isinstance(layer.mlp, SparseMoeBlock)
        ]
