"""Batched multi-LoRA in the model runner: a batch mixing three adapters and the base model gives
each sequence the logits transformers + peft give it alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rankcast import kernels, platform
from rankcast.lora.peft_adapter import load_peft_adapter
from rankcast.model import ops
from rankcast.model.loader import load_model
from rankcast.model_files.arch import ArchConfig
from rankcast.protocol import ScheduledSequence, SchedulerOutput
from rankcast.worker.model_runner import ModelRunner
from tests.model.test_llama_logits import decoder_stack_expected


def _runner(model_dir: Path) -> ModelRunner:
    arch = ArchConfig.from_model_dir(model_dir)
    model = load_model(model_dir, arch, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, arch, 4, torch.device("cpu"), torch.float32)
    runner.initialize_cache(64)
    runner.enable_lora(max_loras=4, max_rank=8)
    return runner


def _reference_logits(model_dir: Path, adapter: Path | None, tokens: list[int]) -> torch.Tensor:
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter))
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]


@pytest.fixture(params=["kernel", "tiles", "torch"])
def lora_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every way adapters are applied: rankcast's CPU kernel (where it is built) from float32
    slots, the same from bfloat16 slots packed for AMX tiles (a bfloat16 model, where the
    build has tiles; a float32 model keeps float32 slots) and torch's masked matmuls (CUDA,
    float16, no kernels)."""
    if request.param != "torch" and not kernels.load():
        pytest.skip("the kernels are not built here")
    if request.param == "tiles" and not torch.ops.rankcast.lora_tiles_supported():
        pytest.skip("this build or CPU has no AMX tiles")
    if request.param == "kernel":
        monkeypatch.setattr(ops, "lora_tiles_apply", lambda weight: False)
    if request.param == "torch":
        monkeypatch.setattr(ops, "lora_kernel_applies", lambda weight: False)
    return str(request.param)


def test_a_mixed_batch_matches_each_adapter_alone(
    tiny_llama_dir: Path, mixed_adapters: list[Path], lora_path: str
) -> None:
    runner = _runner(tiny_llama_dir)
    assert runner.lora_context is not None
    assert runner.lora_context.kernel == (lora_path != "torch")
    arch = runner.arch
    for slot, path in enumerate(mixed_adapters):
        runner.set_lora(slot, load_peft_adapter(path.name, path, arch, max_lora_rank=8))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (5, 9, 3, 7)]
    slots = [0, 1, 2, -1]
    blocks = [[0, 1], [2, 3, 4], [5], [6, 7]]
    batch = SchedulerOutput(
        [
            ScheduledSequence(f"r{i}", p, 0, b, lora_slot=s)
            for i, (p, b, s) in enumerate(zip(prompts, blocks, slots, strict=True))
        ],
    )
    got = runner.compute_logits(batch)
    want = torch.stack(
        [
            _reference_logits(tiny_llama_dir, mixed_adapters[s] if s >= 0 else None, p)
            for p, s in zip(prompts, slots, strict=True)
        ]
    )
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # One decode step each, still mixed: the single-token path uses the same slots.
    for prompt, row in zip(prompts, got, strict=True):
        prompt.append(int(row.argmax()))
    decode = SchedulerOutput(
        [
            ScheduledSequence(f"r{i}", p[-1:], len(p) - 1, b, lora_slot=s)
            for i, (p, b, s) in enumerate(zip(prompts, blocks, slots, strict=True))
        ],
    )
    want = torch.stack(
        [
            _reference_logits(tiny_llama_dir, mixed_adapters[s] if s >= 0 else None, p)
            for p, s in zip(prompts, slots, strict=True)
        ]
    )
    torch.testing.assert_close(runner.compute_logits(decode), want, atol=1e-4, rtol=0)
    for prompt in prompts:
        prompt.pop()
    base = _reference_logits(tiny_llama_dir, None, prompts[0])
    assert (got[0] - base).abs().max() > 1e-2, "the adapter changed the output"

    # A cleared slot is the base model again.
    runner.clear_lora(0)
    again = runner.compute_logits(
        SchedulerOutput([ScheduledSequence("x", prompts[0], 0, [8, 9], lora_slot=0)])
    )
    torch.testing.assert_close(again[0], base, atol=1e-4, rtol=0)


class _CountingStack:
    """Wraps the model's C++ decoder stack to count the steps it ran (the stack itself runs)."""

    def __init__(self, stack: Any) -> None:
        self.stack = stack
        self.calls = 0

    def forward(self, *args: Any) -> Any:
        self.calls += 1
        return self.stack.forward(*args)


def test_steps_without_an_adapter_keep_the_fused_decoder_stack(
    tiny_llama_dir: Path, mixed_adapters: list[Path]
) -> None:
    """Enabling LoRA keeps the C++ stack for steps where no token uses a loaded adapter, and, with
    the adapters applied by the CPU kernel, for steps where one does: the stack adds the deltas."""
    runner = _runner(tiny_llama_dir)
    assert (runner.model.fused_layers is not None) == decoder_stack_expected(torch.float32)
    if runner.model.fused_layers is None:
        pytest.skip("the C++ decoder stack does not run on this CPU")
    assert runner.model.stack_adds_deltas
    stack = _CountingStack(runner.model.fused_layers)
    runner.model.fused_layers = stack
    prompt = [5, 17, 300, 41]

    def step(slot: int) -> torch.Tensor:
        batch = SchedulerOutput([ScheduledSequence("x", prompt, 0, [0], lora_slot=slot)])
        logits = runner.compute_logits(batch)
        assert logits is not None
        return logits[0]

    base = _reference_logits(tiny_llama_dir, None, prompt)
    torch.testing.assert_close(step(-1), base, atol=1e-4, rtol=0)
    assert stack.calls == 1
    # A slot that holds nothing yet adds nothing: still the stack.
    torch.testing.assert_close(step(1), base, atol=1e-4, rtol=0)
    assert stack.calls == 2
    runner.set_lora(1, load_peft_adapter("a", mixed_adapters[0], runner.arch, max_lora_rank=8))
    want = _reference_logits(tiny_llama_dir, mixed_adapters[0], prompt)
    torch.testing.assert_close(step(1), want, atol=1e-4, rtol=0)
    assert stack.calls == 3
    torch.testing.assert_close(step(-1), base, atol=1e-4, rtol=0)
    assert stack.calls == 4


@pytest.mark.parametrize(
    ("dtype", "scheme"),
    [(torch.float32, "none"), (torch.bfloat16, "none"), (torch.bfloat16, "int8")],
    ids=["float32", "bfloat16", "bfloat16-int8"],
)
def test_the_fused_stack_adds_each_tokens_adapter_as_the_modules_do(
    tiny_llama_dir: Path, mixed_adapters: list[Path], dtype: torch.dtype, scheme: str
) -> None:
    """A step mixing adapters of different ranks and the base model gives the same logits, bit
    for bit, through the C++ stack (deltas added by csrc/lora.cpp after each projection) as
    through the modules; slots written after the stack was built are the ones it reads."""
    arch = ArchConfig.from_model_dir(tiny_llama_dir)
    model = load_model(tiny_llama_dir, arch, dtype, torch.device("cpu"), quantization=scheme)
    runner = ModelRunner(model, arch, 4, torch.device("cpu"), dtype)
    runner.initialize_cache(64)
    runner.enable_lora(max_loras=4, max_rank=8)
    if runner.model.fused_layers is None or not decoder_stack_expected(dtype):
        pytest.skip("the C++ decoder stack does not run on this CPU")
    stack = _CountingStack(runner.model.fused_layers)
    for slot, path in enumerate(mixed_adapters):
        runner.set_lora(slot, load_peft_adapter(path.name, path, arch, max_lora_rank=8))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (6, 3, 9, 4)]
    slots = [2, -1, 0, 1]

    def logits(fused: bool, first_block: int) -> torch.Tensor:
        runner.model.fused_layers = stack if fused else None
        steps = []
        for i, (p, s) in enumerate(zip(prompts, slots, strict=True)):
            blocks = list(range(first_block + 3 * i, first_block + 3 * i + 3))  # 4 tokens each
            steps.append(ScheduledSequence(f"r{i}", p, 0, blocks, lora_slot=s))
        got = runner.compute_logits(SchedulerOutput(steps))
        assert got is not None
        return got

    fused, modules = logits(True, 0), logits(False, 12)
    assert stack.calls == 1
    assert torch.equal(fused, modules)
    base = _reference_logits(tiny_llama_dir, None, prompts[0])
    assert (fused[0].float() - base).abs().max() > 1e-2, "the adapter changed the output"


@pytest.mark.parametrize("native_bf16", [False, True], ids=["emulated-bf16", "native-bf16"])
def test_a_bfloat16_model_runs_its_adapters_in_the_platforms_compute_dtype(
    tiny_llama_dir: Path,
    mixed_adapters: list[Path],
    monkeypatch: pytest.MonkeyPatch,
    native_bf16: bool,
    lora_path: str,
) -> None:
    """The kernel computes in float32. Without it, where bfloat16 matmuls are emulated (AVX2
    only) the slots are float32 too, the layer's input cast once and the delta rounded once into
    the bfloat16 output. Every way, a mixed batch gives each sequence its own adapter's logits,
    to bfloat16's precision."""
    monkeypatch.setattr(platform, "cpu_has_fast_bf16", lambda: native_bf16)
    arch = ArchConfig.from_model_dir(tiny_llama_dir)
    model = load_model(tiny_llama_dir, arch, torch.bfloat16, torch.device("cpu"))
    runner = ModelRunner(model, arch, 4, torch.device("cpu"), torch.bfloat16)
    runner.initialize_cache(64)
    runner.enable_lora(max_loras=4, max_rank=8)
    bf16_slots = (native_bf16 and lora_path == "torch") or lora_path == "tiles"
    want_dtype = torch.bfloat16 if bf16_slots else torch.float32
    assert runner.lora_context is not None and runner.lora_context.dtype == want_dtype
    assert runner.lora_context.tiles == (lora_path == "tiles")
    for projections in runner.lora_layers.values():
        for projection in projections:
            assert projection.a.dtype == want_dtype
            assert all(b.dtype == want_dtype for b in projection.b)
            # Packed for tiles: [subs, slots, P, K/2, w, 2] (rankcast/lora/tile_layout.py).
            assert projection.a.dim() == (6 if lora_path == "tiles" else 2)
    for slot, path in enumerate(mixed_adapters):
        runner.set_lora(slot, load_peft_adapter(path.name, path, arch, max_lora_rank=8))
    prompts = [[5, 17, 300, 41], [9, 8, 7], [100, 200, 300, 400, 500]]
    slots = [0, 2, -1]
    batch = SchedulerOutput(
        [
            ScheduledSequence(f"r{i}", p, 0, [2 * i, 2 * i + 1], lora_slot=s)
            for i, (p, s) in enumerate(zip(prompts, slots, strict=True))
        ]
    )
    got = runner.compute_logits(batch)
    assert got is not None
    for row, prompt, slot in zip(got, prompts, slots, strict=True):
        adapter = mixed_adapters[slot] if slot >= 0 else None
        want = _reference_logits(tiny_llama_dir, adapter, prompt)
        torch.testing.assert_close(row.float(), want, atol=0.05, rtol=0.05)
        if slot >= 0:
            base = _reference_logits(tiny_llama_dir, None, prompt)
            assert (row.float() - base).abs().max() > 0.1, "the adapter changed the output"


def test_tensor_parallel_slots_add_up_to_the_whole_delta(
    mixed_adapters: list[Path], tiny_llama_dir: Path, lora_path: str
) -> None:
    """Column-parallel ranks produce their slices of the delta; row-parallel ranks' partial
    deltas sum (in the layer's all-reduce) to the whole."""
    from rankcast.lora.layers import LoRABatch, LoRAContext, LoRALinear, SubProjection

    arch = ArchConfig.from_model_dir(tiny_llama_dir)
    adapter = load_peft_adapter("a", mixed_adapters[0], arch, max_lora_rank=8)
    # Tiles: bfloat16 slots, steps and outputs; the columns a rank computes are the same bits
    # as the whole's, the row-parallel partial deltas sum to it to bfloat16's precision.
    tiles = lora_path == "tiles"
    dtype = torch.bfloat16 if tiles else torch.float32
    context = LoRAContext(1, 8, torch.device("cpu"), dtype, kernel=lora_path != "torch")
    assert context.tiles == tiles
    context.batch = LoRABatch.from_token_slots([0, 0, 0], context)
    hidden, q = arch.hidden_size, arch.num_attention_heads * arch.head_dim
    close = {"atol": 0.02, "rtol": 0.02} if tiles else {}

    def linear(subs: list[SubProjection], in_size: int) -> LoRALinear:
        layer = LoRALinear(context, subs, in_size)
        layer.set_slot(0, adapter, 0)
        return layer

    x = torch.randn(3, hidden).to(dtype)
    whole = torch.zeros(3, q, dtype=dtype)
    linear([SubProjection("q_proj", 0, q)], hidden).add_to(x, whole)
    halves = []
    for rank in range(2):
        out = torch.zeros(3, q // 2, dtype=dtype)
        linear([SubProjection("q_proj", 0, q // 2, shard_index=rank)], hidden).add_to(x, out)
        halves.append(out)
    torch.testing.assert_close(torch.cat(halves, dim=1), whole, atol=0, rtol=0)
    w = adapter.weights[(0, "q_proj")]
    want = adapter.scaling * (x.float() @ w.a.T) @ w.b.T
    torch.testing.assert_close(whole.float(), want, **close)
    assert whole.abs().max() > 0.1, "the adapter added something"

    xo = torch.randn(3, q).to(dtype)
    whole = torch.zeros(3, hidden, dtype=dtype)
    linear([SubProjection("o_proj", 0, hidden, in_shard=0)], q).add_to(xo, whole)
    partial = torch.zeros(3, hidden, dtype=dtype)
    for rank, part in enumerate(xo.chunk(2, dim=1)):
        linear([SubProjection("o_proj", 0, hidden, in_shard=rank)], q // 2).add_to(
            part.contiguous(), partial
        )
    torch.testing.assert_close(partial, whole, **close)


@pytest.mark.parametrize("scheme", ["int8", "w8a8"])
def test_adapters_apply_in_floating_point_on_a_quantized_base(
    tiny_llama_dir: Path, mixed_adapters: list[Path], scheme: str
) -> None:
    """A quantized base model's adapters stay float (as vLLM and punica keep them): the logits of
    the int8 base plus an adapter are as close to transformers + peft as the int8 base alone is
    to transformers, and the adapter moves them as far as it moves the float model's."""
    arch = ArchConfig.from_model_dir(tiny_llama_dir)
    model = load_model(
        tiny_llama_dir, arch, torch.float32, torch.device("cpu"), quantization=scheme
    )
    runner = ModelRunner(model, arch, 4, torch.device("cpu"), torch.float32)
    runner.initialize_cache(64)
    runner.enable_lora(max_loras=2, max_rank=8)
    adapter = mixed_adapters[1]
    runner.set_lora(0, load_peft_adapter(adapter.name, adapter, arch, max_lora_rank=8))
    prompt = torch.randint(0, 1000, (9,), generator=torch.Generator().manual_seed(2)).tolist()

    def ours(slot: int, blocks: list[int]) -> torch.Tensor:
        step = ScheduledSequence(f"s{slot}", prompt, 0, blocks, lora_slot=slot)
        logits = runner.compute_logits(SchedulerOutput([step]))
        assert logits is not None
        return logits[0]

    with_adapter, base = ours(0, [0, 1, 2]), ours(-1, [3, 4, 5])
    want_adapter = _reference_logits(tiny_llama_dir, adapter, prompt)
    want_base = _reference_logits(tiny_llama_dir, None, prompt)
    spread = float(want_base.max() - want_base.min())
    base_error = float((base - want_base).abs().max())
    assert base_error < 0.05 * spread
    assert float((with_adapter - want_adapter).abs().max()) < 2 * base_error + 1e-3
    moved = (with_adapter - base) - (want_adapter - want_base)
    assert (
        float(moved.abs().max())
        < 0.05 * float((want_adapter - want_base).abs().max()) + 2 * base_error
    )
    assert float((with_adapter - base).abs().max()) > 1e-2, "the adapter changed the output"
