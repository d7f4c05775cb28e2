"""rankcast's decoder against transformers on tiny random checkpoints, float32, to 1e-4."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rankcast.model.linear_kernels import choose_linear_path
from rankcast.model.loader import load_model
from rankcast.model_files.arch import ArchConfig
from rankcast.protocol import ScheduledSequence, SchedulerOutput
from rankcast.worker.model_runner import ModelRunner
from tests.conftest import write_tiny_model

VARIANTS = {
    "llama-tied": dict(arch="llama", tie_word_embeddings=True),
    "llama3-rope-untied": dict(
        arch="llama",
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama-linear-rope": dict(arch="llama", rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen2-bias": dict(arch="qwen2", tie_word_embeddings=False),
}


def _runner(model_dir: Path, block_size: int = 4, num_blocks: int = 64) -> ModelRunner:
    arch = ArchConfig.from_model_dir(model_dir)
    model = load_model(model_dir, arch, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, arch, block_size, torch.device("cpu"), torch.float32)
    runner.initialize_cache(num_blocks)
    return runner


def decoder_stack_expected(dtype: torch.dtype) -> bool:
    """The C++ decoder stack runs wherever the model's linears take rankcast's packed kernel
    (`choose_linear_path`: every x86 family with the kernels built, AMX included)."""
    return choose_linear_path(dtype, torch.device("cpu")).kernel == "rankcast"


def _reference(model_dir: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-layers", "module-path"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_logits_match_transformers(
    tmp_path: Path, variant: str, fused: bool
) -> None:
    """Decode steps run the C++ decoder stack when it is built, or the modules; both match."""
    model_dir = write_tiny_model(tmp_path / variant, vocab_size=256, seed=3, **VARIANTS[variant])
    runner = _runner(model_dir)
    assert (runner.model.fused_layers is not None) == decoder_stack_expected(torch.float32)
    if not fused:
        runner.model.fused_layers = None
    reference = _reference(model_dir)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (7, 13, 1)]
    # Deliberately scattered, non-contiguous blocks: paging must not depend on adjacency.
    blocks = [[9, 2, 30, 4, 17], [0, 11, 5, 40, 41, 7], [20, 21, 22]]

    def ours(is_prefill: bool, seqs: list[list[int]]) -> torch.Tensor:
        scheduled = []
        for tokens, table in zip(seqs, blocks, strict=True):
            if is_prefill:
                scheduled.append(ScheduledSequence("r", tokens, 0, table))
            else:
                scheduled.append(ScheduledSequence("r", tokens[-1:], len(tokens) - 1, table))
        return runner.compute_logits(SchedulerOutput(scheduled))

    def theirs(seqs: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            return torch.stack([reference(torch.tensor([s])).logits[0, -1] for s in seqs])

    sequences = [list(p) for p in prompts]
    got = ours(True, sequences)
    want = theirs(sequences)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    for _ in range(6):
        for seq, row in zip(sequences, want, strict=True):
            seq.append(int(row.argmax()))
        got = ours(False, sequences)
        want = theirs(sequences)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("tied", [True, False], ids=["tied-head", "own-head"])
def test_packed_linears_keep_one_copy_of_their_weights(tmp_path: Path, tied: bool) -> None:
    """Once packed, a linear's plain weight holds no storage (the layer is in memory once) but
    keeps its shape, dtype and device; a head tied to the embedding keeps the embedding's
    storage. A batch with leading dimensions goes through the packed weight too."""
    from rankcast.model.layers import PackedLinearMixin

    model_dir = write_tiny_model(tmp_path / "m", vocab_size=256, seed=3, tie_word_embeddings=tied)
    arch = ArchConfig.from_model_dir(model_dir)
    model = load_model(model_dir, arch, torch.float32, torch.device("cpu"))
    linears = [m for m in model.modules() if isinstance(m, PackedLinearMixin)]
    if all(m.packed_weight is None for m in linears):
        pytest.skip("nothing is packed on this platform: the plain weights are the ones read")
    for module in linears:
        weight = module.weight
        stored = weight.untyped_storage().nbytes()
        if module is model.lm_head and tied:
            assert stored == weight.numel() * weight.element_size()
        else:
            assert stored <= weight.element_size()
        assert weight.dtype == torch.float32 and weight.dim() == 2
    qkv = model.layers["0"].self_attn.qkv_proj
    assert qkv.weight.shape == (qkv.q_size + 2 * qkv.kv_size, arch.hidden_size)
    x = torch.randn(2, 3, arch.hidden_size, generator=torch.Generator().manual_seed(1))
    flat = qkv(x.reshape(6, -1))
    assert torch.equal(qkv(x), flat.view(2, 3, -1))


def test_tensor_parallel_shards_reassemble(tmp_path: Path) -> None:
    """Each TP rank's weight loader takes its own slice; the slices tile the full tensors."""
    from rankcast.distributed import TensorParallelGroup

    model_dir = write_tiny_model(tmp_path / "tp", vocab_size=256, seed=1)
    arch = ArchConfig.from_model_dir(model_dir)
    cpu = torch.device("cpu")
    full = load_model(model_dir, arch, torch.float32, cpu, keep_plain_weights=True)
    shards = [
        load_model(
            model_dir,
            arch,
            torch.float32,
            cpu,
            TensorParallelGroup(rank, 2),
            keep_plain_weights=True,
        )
        for rank in range(2)
    ]
    layer = "layers.0"
    for name, dim in (("self_attn.o_proj.weight", 1), ("mlp.down_proj.weight", 1)):
        params = [dict(s.named_parameters())[f"{layer}.{name}"] for s in shards]
        torch.testing.assert_close(
            torch.cat(params, dim=dim), dict(full.named_parameters())[f"{layer}.{name}"]
        )
    qkv = [dict(s.named_parameters())[f"{layer}.self_attn.qkv_proj.weight"] for s in shards]
    q_full = dict(full.named_parameters())[f"{layer}.self_attn.qkv_proj.weight"][: arch.hidden_size]
    q_size = shards[0].layers["0"].self_attn.qkv_proj.q_size
    torch.testing.assert_close(torch.cat([p[:q_size] for p in qkv]), q_full)


def test_bfloat16_decode_through_fused_layers_matches_the_modules(tmp_path: Path) -> None:
    model_dir = write_tiny_model(tmp_path / "bf16", vocab_size=256, seed=4)
    arch = ArchConfig.from_model_dir(model_dir)
    model = load_model(model_dir, arch, torch.bfloat16, torch.device("cpu"))
    runner = ModelRunner(model, arch, 16, torch.device("cpu"), torch.bfloat16)
    runner.initialize_cache(16)
    if not decoder_stack_expected(torch.bfloat16):
        pytest.skip("the C++ decoder stack needs the kernels' bfloat16 packed linear")
    prompts = [[5, 9, 200, 31, 7], list(range(40, 61))]
    tables = [[3, 8], [0, 12]]
    runner.compute_logits(
        SchedulerOutput(
            [ScheduledSequence("r", p, 0, t) for p, t in zip(prompts, tables, strict=True)]
        )
    )
    step = SchedulerOutput(
        [ScheduledSequence("r", [11], len(p), t) for p, t in zip(prompts, tables, strict=True)],
    )
    fused = runner.compute_logits(step)
    stack, runner.model.fused_layers = runner.model.fused_layers, None
    modules = runner.compute_logits(step)
    assert stack is not None
    torch.testing.assert_close(fused, modules, atol=2e-2, rtol=2e-2)


def test_mistral_and_qwen2_sliding_windows_are_read_per_layer_as_their_configs_set_them() -> None:
    """Mistral's window (set: every layer, as MistralConfig applies it), Qwen2's (only with
    use_sliding_window, from max_window_layers on, or as layer_types says); the context is the
    model's whole context either way (the attention is windowed, not the context capped)."""
    from rankcast.model_files.arch import ArchConfig

    base = {
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 32768,
    }
    mistral = {**base, "architectures": ["MistralForCausalLM"]}
    windowed_mistral = ArchConfig.from_dict({**mistral, "sliding_window": 4096})
    assert windowed_mistral.layer_windows == (4096, 4096)
    assert windowed_mistral.max_position_embeddings == 32768
    assert ArchConfig.from_dict({**mistral, "sliding_window": None}).layer_windows == ()
    qwen2 = {**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096}
    assert ArchConfig.from_dict(qwen2).layer_windows == ()
    windowed = {**qwen2, "use_sliding_window": True}
    assert ArchConfig.from_dict(windowed).layer_windows == ()  # max_window_layers 28 > 2
    assert ArchConfig.from_dict({**windowed, "max_window_layers": 1}).layer_windows == (0, 4096)
    given = {**windowed, "layer_types": ["sliding_attention", "full_attention"]}
    assert ArchConfig.from_dict(given).layer_windows == (4096, 0)
