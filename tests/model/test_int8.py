"""int8 weights (`--quantization int8`): csrc/gemm_int8.cpp against torch, bit for bit, on every
ISA build (tests/model/test_cpu_families.py runs this file on the AVX-512-without-VNNI and AVX2
builds too); a quantized model against its float self; the decoder stack, the torch path and
weight snapshots on int8 models."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from rankcast import kernels
from rankcast.model import ops
from rankcast.model.arch import ArchConfig
from rankcast.model.layers import PackedLinearMixin
from rankcast.model.linear_kernels import CpuFacts, choose_linear_path
from rankcast.model.loader import load_model
from rankcast.model.weight_snapshot import WeightSnapshot
from rankcast.protocol import ScheduledSequence, SchedulerOutput
from rankcast.worker.model_runner import ModelRunner
from tests.conftest import write_tiny_model
from tests.model.test_weight_snapshot import MAPPED, captured

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]


def _int8_kernel() -> str:
    if not kernels.load():
        return "none"
    return str(torch.ops.rankcast.int8_path())


needs_kernel = pytest.mark.skipif(_int8_kernel() == "none", reason="no int8 kernel in this build")


def _quantized(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen)
    values, scales = ops.quantize_int8_weight(weight)
    return weight, values, scales


def _kernel(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, bias=None):
    packed = torch.ops.rankcast.pack_int8_weight(values)
    return torch.ops.rankcast.int8_linear(x, packed, values.shape[0], scales, bias)


def test_weights_quantize_per_output_channel_within_half_a_step() -> None:
    weight, values, scales = _quantized(37, 53, seed=1)
    assert values.dtype == torch.int8 and scales.shape == (37,)
    assert int(values.abs().max()) == 127  # each row's largest weight takes the whole range
    error = (values.float() * scales[:, None] - weight).abs()
    assert bool((error <= scales[:, None] / 2 + 1e-7).all())
    zero_values, zero_scales = ops.quantize_int8_weight(torch.zeros(3, 8))
    assert not zero_values.any() and not zero_scales.any()


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 1, 1), (1, 16, 4), (3, 17, 5), (8, 48, 64), (9, 50, 77), (33, 100, 3), (70, 49, 130)],
)
def test_the_kernel_equals_the_torch_reference_bit_for_bit(
    dtype: torch.dtype, m: int, n: int, k: int
) -> None:
    """Ragged shapes (partial panels, k not a whole group, rows across tiles and row blocks),
    with and without a bias: the integer sums are exact, so the result is the reference's."""
    _, values, scales = _quantized(n, k, seed=m * 1000 + n + k)
    gen = torch.Generator().manual_seed(k)
    x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
    bias = torch.randn(n, generator=gen)
    for b in (None, bias):
        got = _kernel(x, values, scales, b)
        want = ops.int8_linear_reference(x, values, scales, b)
        assert got.dtype == dtype
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_the_kernel_is_close_to_dequantize_then_matmul(dtype: torch.dtype) -> None:
    """The quantized product equals the float product of the dequantized operands up to float32
    accumulation (every operand dequantized exactly as the kernel scales it)."""
    _, values, scales = _quantized(96, 576, seed=5)
    x = torch.randn(12, 576, generator=torch.Generator().manual_seed(6)).to(dtype)
    got = _kernel(x, values, scales).float()
    rows, row_scales = ops._quantize_rows(x.float())
    want = (rows * row_scales[:, None]) @ (values.float() * scales[:, None]).T
    torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-5)


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_rows_beside_it() -> None:
    _, values, scales = _quantized(80, 200, seed=7)
    batch = torch.randn(40, 200, generator=torch.Generator().manual_seed(8)).bfloat16()
    together = _kernel(batch, values, scales)
    for i in (0, 13, 39):
        assert torch.equal(_kernel(batch[i : i + 1], values, scales)[0], together[i])
        assert torch.equal(_kernel(batch[i : i + 5], values, scales)[0], together[i])


@needs_kernel
def test_a_zero_row_gives_the_bias_and_bad_input_is_refused() -> None:
    _, values, scales = _quantized(20, 33, seed=9)
    bias = torch.arange(20, dtype=torch.float32)
    assert torch.equal(_kernel(torch.zeros(2, 33), values, scales, bias)[1], bias)
    packed = torch.ops.rankcast.pack_int8_weight(values)
    with pytest.raises(RuntimeError, match="int8 \\[out, in\\]"):
        torch.ops.rankcast.pack_int8_weight(values.float())
    with pytest.raises(RuntimeError, match="another shape"):
        torch.ops.rankcast.int8_linear(torch.zeros(1, 40), packed, 20, scales, None)
    with pytest.raises(RuntimeError, match="scales must be float32"):
        torch.ops.rankcast.int8_linear(torch.zeros(1, 33), packed, 20, scales[:5], None)


def test_the_torch_path_is_the_reference_up_to_float32_sums() -> None:
    """Where the kernels are not built (CUDA too) int8 weights multiply through torch: the
    reference with float32 instead of exact sums."""
    _, values, scales = _quantized(64, 300, seed=11)
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(12))
    fast = ops.int8_linear_reference(x, values, scales, None, exact=False)
    torch.testing.assert_close(fast, ops.int8_linear_reference(x, values, scales, None))
    weight = ops.pack_linear_weight(torch.randn(64, 300), "torch", quantization="int8")
    assert weight is not None and weight.backend == "torch" and weight.tensor.dtype == torch.int8
    assert ops.packed_linear(x, weight, None).shape == (5, 64)


def test_the_path_for_int8_weights() -> None:
    vnni = CpuFacts("avx512-bf16", frozenset(), frozenset(), "avx512-vnni")
    absent = CpuFacts("other", frozenset(), frozenset(), "none")
    path = choose_linear_path(torch.bfloat16, CPU, "auto", vnni, quantization="int8")
    assert path.kernel == "rankcast" and path.batch_invariant and "avx512-vnni" in path.reason
    assert choose_linear_path(torch.float32, CPU, "auto", absent, "int8").kernel == "torch"
    cuda = choose_linear_path(torch.float16, torch.device("cuda"), "auto", vnni, "int8")
    assert cuda.kernel == "torch" and not cuda.batch_invariant
    assert choose_linear_path(torch.float32, CPU, "torch", vnni, "int8").kernel == "torch"
    with pytest.raises(ValueError, match="onednn has no int8"):
        choose_linear_path(torch.float32, CPU, "onednn", vnni, "int8")
    with pytest.raises(ValueError, match="no int8 matmul"):
        choose_linear_path(torch.float32, CPU, "rankcast", absent, "int8")


# ---- a whole model


def _runner(model_dir: Path, dtype: torch.dtype, quantization: str, **load) -> ModelRunner:
    arch = ArchConfig.from_model_dir(model_dir)
    model = load_model(model_dir, arch, dtype, CPU, quantization=quantization, **load)
    runner = ModelRunner(model, arch, 4, CPU, dtype)
    runner.initialize_cache(64)
    return runner


def _logits(runner: ModelRunner, prompt: list[int], steps: int = 4) -> torch.Tensor:
    """A prompt's last logits, then greedy decodes of the float model's choices."""
    table = [9, 2, 30, 4, 17, 1, 3]
    rows = [runner.compute_logits(SchedulerOutput([ScheduledSequence("r", prompt, 0, table)]))]
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(rows[-1][0].argmax()))
        step = ScheduledSequence("r", tokens[-1:], len(tokens) - 1, table)
        rows.append(runner.compute_logits(SchedulerOutput([step])))
    return torch.cat(rows).float()


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_a_quantized_model_stays_close_to_the_float_one(tmp_path: Path, dtype) -> None:
    """Bound on the tiny random model: int8 logits within 5 % of the float model's logit range
    (random weights have no outliers to hide; the real model's cost is the perplexity in
    bench/perplexity.py)."""
    model_dir = write_tiny_model(tmp_path / "m", vocab_size=256, seed=3, tie_word_embeddings=False)
    prompt = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(0)).tolist()
    want = _logits(_runner(model_dir, dtype, "none"), prompt)
    quantized = _runner(model_dir, dtype, "int8")
    got = _logits(quantized, prompt)
    spread = float(want.max() - want.min())
    assert float((got - want).abs().max()) < 0.05 * spread
    linears = [m for m in quantized.model.modules() if isinstance(m, PackedLinearMixin)]
    assert linears and all(
        m.packed_weight is not None and m.packed_weight.quantization == "int8" for m in linears
    )


@needs_kernel
def test_the_decoder_stack_runs_int8_layers_as_the_modules_do(tmp_path: Path) -> None:
    model_dir = write_tiny_model(tmp_path / "m", vocab_size=256, seed=4, arch="qwen2")
    prompt = list(range(3, 17))
    fused = _runner(model_dir, torch.bfloat16, "int8")
    assert fused.model.fused_layers is not None
    modules = _runner(model_dir, torch.bfloat16, "int8")
    modules.model.fused_layers = None
    assert torch.equal(_logits(fused, prompt), _logits(modules, prompt))


@needs_kernel
def test_an_int8_snapshot_is_mapped_and_computes_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot holds the int8 values and scales; a float start never maps it (the key holds
    the quantization) and an int8 start maps it."""
    monkeypatch.setenv("RANKCAST_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = write_tiny_model(tmp_path / "m", vocab_size=250, tie_word_embeddings=False)
    args = (model_dir, torch.bfloat16, CPU, None, None, "rankcast")
    snapshot = WeightSnapshot.for_rank(*args, "int8")
    assert snapshot is not None and snapshot != WeightSnapshot.for_rank(*args)
    prompt = list(range(5, 15))
    first = _logits(_runner(model_dir, torch.bfloat16, "int8", weight_snapshots=True), prompt)
    deadline = time.monotonic() + 30
    while not snapshot.path.is_file():
        assert time.monotonic() < deadline, "no int8 snapshot written"
        time.sleep(0.02)
    with captured("rankcast.model.loader") as log:
        mapped = _runner(model_dir, torch.bfloat16, "int8", weight_snapshots=True)
    assert f"{MAPPED} {snapshot.path}" in log.text
    assert torch.equal(_logits(mapped, prompt), first)
    plain = WeightSnapshot.for_rank(*args)
    assert plain is not None and not plain.path.exists()
