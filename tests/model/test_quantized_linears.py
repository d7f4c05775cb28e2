"""Quantized weights: `--quantization int8` (weight-only, csrc/gemm.cpp's float kernels widening
int8), `w8a8` (csrc/gemm_w8a8.cpp), `q4_1` (csrc/gemm_q4.cpp) and `q8_0` (csrc/gemm_q8.cpp)
against torch, and Q6_K as stored (csrc/gemm_q6k.cpp, a GGUF's LM head), on every ISA build
(tests/model/test_cpu_families.py runs this file on the AVX-512-without-VNNI and AVX2 builds
too); a quantized model against its float self; the decoder stack, the torch path and weight
snapshots on quantized models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rankcast import kernels
from rankcast.model import ops
from rankcast.model import quantization as quantized
from rankcast.model.layers import PackedLinearMixin, layer_quantization
from rankcast.model.linear_kernels import CpuFacts, choose_linear_path
from rankcast.model.loader import load_model
from rankcast.model.weight_snapshot import WeightSnapshot
from rankcast.model_files.arch import ArchConfig
from rankcast.protocol import ScheduledSequence, SchedulerOutput
from rankcast.worker.model_runner import ModelRunner
from tests.conftest import write_tiny_model
from tests.model.family_models import random_q6_k_rows
from tests.model.test_weight_snapshot import MAPPED, _wait_for_snapshot, captured

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]


SCHEMES = ["int8", "w8a8"]
ALL_SCHEMES = [*SCHEMES, "q4_0", "q4_1", "q8_0"]


def _w8a8_kernel() -> str:
    if not kernels.load():
        return "none"
    return str(torch.ops.rankcast.w8a8_path())


needs_kernel = pytest.mark.skipif(_w8a8_kernel() == "none", reason="no int8 kernels in this build")


def _quantized(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen)
    values, scales = quantized.quantize_int8_weight(weight)
    return weight, values, scales


def _kernel(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, bias=None):
    packed = torch.ops.rankcast.pack_w8a8_weight(values)
    return torch.ops.rankcast.w8a8_linear(x, packed, values.shape[0], scales, bias)


def _q4(x: torch.Tensor, weight: torch.Tensor, bias=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel, reference) for `weight` quantized to 4-bit groups."""
    values, d, m = quantized.quantize_q4_1_weight(weight)
    packed = torch.ops.rankcast.pack_q4_weight(values, d, m)
    got = torch.ops.rankcast.q4_linear(x, packed, weight.shape[0], bias)
    return got, quantized.q4_1_linear_reference(x, values, d, m, bias)


def _q8(x: torch.Tensor, weight: torch.Tensor, bias=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel, reference) for `weight` quantized to 8-bit groups."""
    values, d = quantized.quantize_q8_0_weight(weight)
    packed = torch.ops.rankcast.pack_q8_weight(values, d)
    got = torch.ops.rankcast.q8_linear(x, packed, weight.shape[0], bias)
    return got, quantized.q8_0_linear_reference(x, values, d, bias)


def _weight_only(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, bias=None):
    packed = torch.ops.rankcast.pack_int8_weight(values, x.dtype)
    return torch.ops.rankcast.packed_linear(x, packed, values.shape[0], bias, scales)


def test_weights_quantize_per_output_channel_within_half_a_step() -> None:
    weight, values, scales = _quantized(37, 53, seed=1)
    assert values.dtype == torch.int8 and scales.shape == (37,)
    assert int(values.abs().max()) == 127  # each row's largest weight takes the whole range
    error = (values.float() * scales[:, None] - weight).abs()
    assert bool((error <= scales[:, None] / 2 + 1e-7).all())
    zero_values, zero_scales = quantized.quantize_int8_weight(torch.zeros(3, 8))
    assert not zero_values.any() and not zero_scales.any()


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [
        (1, 1, 1),
        (1, 16, 4),
        (3, 17, 5),
        (8, 48, 64),
        (9, 50, 77),
        (33, 100, 3),
        (70, 49, 130),
        (40, 50, 96),
    ],
)
def test_both_kernels_equal_their_torch_references(
    dtype: torch.dtype, m: int, n: int, k: int
) -> None:
    """Ragged shapes (partial panels, k not a whole group, rows across tiles and row blocks),
    with and without a bias. W8A8's integer sums are exact, so it is the reference bit for bit;
    weight-only int8 sums float32 products in its own order, so it is the reference up to that
    (and one rounding of the output)."""
    _, values, scales = _quantized(n, k, seed=m * 1000 + n + k)
    gen = torch.Generator().manual_seed(k)
    x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
    bias = torch.randn(n, generator=gen)
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3
    for b in (None, bias):
        got = _kernel(x, values, scales, b)
        want = quantized.w8a8_linear_reference(x, values, scales, b)
        assert got.dtype == dtype
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()
        got = _weight_only(x, values, scales, b)
        want = quantized.int8_weight_reference(x, values, scales, b)
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
        for grouped in (_q4, _q8):
            got, want = grouped(x, torch.randn(n, k, generator=gen), b)
            assert got.dtype == dtype
            torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_rows_round_half_to_even_as_the_references_do(dtype: torch.dtype) -> None:
    """Activations that land exactly half-way between integers (the row's largest element set so
    that its scale is 1) round to even in every integer kernel, as torch.round does in the
    references: the vectorized row quantization (csrc/quantize_rows.h) keeps the scalar
    definition. Weights chosen so that every later step is exact: the results are equal. (The
    15-bit kernels' scale-1 row needs 16383, which bfloat16 cannot hold: float32 rows only.)"""
    halves = torch.tensor([2.5, -3.5, 0.5, -0.5, 1.5, -2.5, 6.5, -7.5] * 8)
    gen = torch.Generator().manual_seed(3)
    for top in (127.0, 16383.0):  # the W8A8 and the 15-bit group kernels' largest integer
        if top == 16383.0 and dtype == torch.bfloat16:
            continue
        x = torch.cat([torch.tensor([top]), halves[: 64 - 1]]).view(1, 64).to(dtype)
        if top == 127.0:
            values = torch.randint(-127, 128, (16, 64), generator=gen, dtype=torch.int8)
            scales = torch.ones(16)
            want = quantized.w8a8_linear_reference(x, values, scales, None)
            assert torch.equal(_kernel(x, values, scales), want)
            continue
        q8 = torch.randint(-3, 4, (16, 64), generator=gen).float()  # float32 sums stay exact
        q8[:, 0], q8[:, 32] = 127.0, -127.0  # every group's scale is exactly 1
        values, d = quantized.quantize_q8_0_weight(q8)
        assert bool((d == 1).all())
        got, want = _q8(x, q8)
        assert torch.equal(got, want)


def test_8bit_groups_give_back_the_values_a_q8_0_file_held() -> None:
    """Weights dequantized from llama.cpp's Q8_0 (each group's largest |q| is 127, d float16)
    quantize to the very same q and d."""
    values, d = quantized.quantize_q8_0_weight(torch.randn(40, 96))
    assert int(values.abs().view(40, 3, 32).amax(dim=2).min()) == 127
    from_file = values.view(40, 3, 32).float() * d.float()[..., None]
    again = quantized.quantize_q8_0_weight(from_file.view(40, 96))
    assert torch.equal(again[0], values) and torch.equal(again[1], d)
    zeros, zero_d = quantized.quantize_q8_0_weight(torch.zeros(2, 40))  # padded, all-zero groups
    assert zeros.shape == (2, 64) and not zeros.any() and not zero_d.any()


def test_q4_0_is_q4_1_arithmetic_with_its_own_values() -> None:
    """Q4_0 groups (w = d * (q - 8)) as the 4-bit kernel takes them: m = -8 d exactly, and a
    Q4_0 file's dequantized weights give back its q and d (llama.cpp's own encoding:
    tests/model/test_gguf.py), so the kernel multiplies the file's weights."""
    values, d, m = quantized.quantize_q4_0_weight(torch.randn(40, 96))
    assert torch.equal(m.float(), d.float() * -8)
    from_file = ((values.view(40, 3, 32).float() - 8) * d.float()[..., None]).view(40, 96)
    again = quantized.quantize_q4_0_weight(from_file)
    assert all(torch.equal(a, b) for a, b in zip(again, (values, d, m), strict=True))
    weight = ops.pack_linear_weight(from_file, "torch", quantization="q4_0")
    assert weight is not None and weight.groups is not None
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1))
    rows, scale = quantized._quantize_rows_15(x, 96)  # the rows as every 4-bit path takes them
    torch.testing.assert_close(
        ops.packed_linear(x, weight, None), (rows * scale[:, None]) @ from_file.T
    )


def test_4bit_groups_give_back_the_values_a_q4_1_file_held() -> None:
    """Weights dequantized from llama.cpp's Q4_1 (the embedded SmolLM2's layers) quantize to the
    very same q, d and m: serving them this way is serving the file's own weights."""
    values, d, m = quantized.quantize_q4_1_weight(torch.randn(40, 96))
    assert int(values.max()) == 15 and int(values.min()) == 0
    from_file = values.view(40, 3, 32).float() * d.float()[..., None] + m.float()[..., None]
    again = quantized.quantize_q4_1_weight(from_file.view(40, 96))
    assert all(torch.equal(a, b) for a, b in zip(again, (values, d, m), strict=True))
    # Ragged in: zero-padded to whole groups.
    padded, _, _ = quantized.quantize_q4_1_weight(torch.randn(3, 40))
    assert padded.shape == (3, 64)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_the_kernels_are_close_to_dequantize_then_matmul(dtype: torch.dtype) -> None:
    """Each quantized product equals the float product of its dequantized operands up to float32
    accumulation (every operand dequantized exactly as the kernel scales it)."""
    _, values, scales = _quantized(96, 576, seed=5)
    x = torch.randn(12, 576, generator=torch.Generator().manual_seed(6)).to(dtype)
    weight = values.float() * scales[:, None]
    rows, row_scales = quantized._quantize_rows(x.float())
    tolerance = {"rtol": 1e-5 if dtype == torch.float32 else 8e-3, "atol": 1e-4}
    torch.testing.assert_close(
        _kernel(x, values, scales).float(), (rows * row_scales[:, None]) @ weight.T, **tolerance
    )
    torch.testing.assert_close(
        _weight_only(x, values, scales).float(), x.float() @ weight.T, **tolerance
    )
    values, d, m = quantized.quantize_q4_1_weight(torch.randn(96, 576))
    dequantized = values.view(96, -1, 32).float() * d.float()[..., None] + m.float()[..., None]
    got = torch.ops.rankcast.q4_linear(x, torch.ops.rankcast.pack_q4_weight(values, d, m), 96, None)
    amax = x.float().abs().amax(dim=1, keepdim=True)  # rows in 15 bits, as the kernel takes them
    rows = torch.round(x.float() * (torch.full_like(amax, 16383.0) / amax)) * (amax / 16383)
    torch.testing.assert_close(got.float(), rows @ dequantized.view(96, 576).T, **tolerance)
    values8, d8 = quantized.quantize_q8_0_weight(torch.randn(96, 576))
    dequantized = (values8.view(96, -1, 32).float() * d8.float()[..., None]).view(96, 576)
    got = torch.ops.rankcast.q8_linear(x, torch.ops.rankcast.pack_q8_weight(values8, d8), 96, None)
    torch.testing.assert_close(got.float(), rows @ dequantized.T, **tolerance)


def _q4_only(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    weight = values.float() * scales[:, None]
    return _q4(x, weight)[0]


def _q8_only(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    weight = values.float() * scales[:, None]
    return _q8(x, weight)[0]


@needs_kernel
@pytest.mark.parametrize(
    "multiply", [_kernel, _weight_only, _q4_only, _q8_only], ids=["w8a8", "int8", "q4_1", "q8_0"]
)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(multiply, dtype) -> None:
    """40 rows against 1 and 5: a batch's blocks run several row tiles per column group (and
    widen weight-only int8 once for all of them, csrc/gemm.h), a few rows one tile. K 256 as
    well as 200: on an AMX build weight-only int8 under bfloat16 rows takes the tiles where K is
    a multiple of 32, converting a column group once for a step of more than 32 rows and each
    tile as it is used for fewer (csrc/gemm_amx.cpp)."""
    for k in (200, 256):
        _, values, scales = _quantized(80, k, seed=7)
        batch = torch.randn(40, k, generator=torch.Generator().manual_seed(8)).to(dtype)
        together = multiply(batch, values, scales)
        for i in (0, 13, 39):
            assert torch.equal(multiply(batch[i : i + 1], values, scales)[0], together[i])
            assert torch.equal(multiply(batch[i : i + 5], values, scales)[0], together[i])


@needs_kernel
def test_a_zero_row_gives_the_bias_and_bad_input_is_refused() -> None:
    _, values, scales = _quantized(20, 33, seed=9)
    bias = torch.arange(20, dtype=torch.float32)
    assert torch.equal(_kernel(torch.zeros(2, 33), values, scales, bias)[1], bias)
    assert torch.equal(_weight_only(torch.zeros(2, 33), values, scales, bias)[1], bias)
    packed = torch.ops.rankcast.pack_w8a8_weight(values)
    with pytest.raises(RuntimeError, match="int8 \\[out, in\\]"):
        torch.ops.rankcast.pack_w8a8_weight(values.float())
    with pytest.raises(RuntimeError, match="another shape"):
        torch.ops.rankcast.w8a8_linear(torch.zeros(1, 40), packed, 20, scales, None)
    with pytest.raises(RuntimeError, match="scales must be float32"):
        torch.ops.rankcast.w8a8_linear(torch.zeros(1, 33), packed, 20, scales[:5], None)
    packed = torch.ops.rankcast.pack_int8_weight(values, torch.float32)
    with pytest.raises(RuntimeError, match="int8 \\[out, in\\]"):
        torch.ops.rankcast.pack_int8_weight(values.float(), torch.float32)
    with pytest.raises(RuntimeError, match="another K"):
        torch.ops.rankcast.packed_linear(torch.zeros(1, 40), packed, 20, None, scales)
    with pytest.raises(RuntimeError, match="need float32 scales"):
        torch.ops.rankcast.packed_linear(torch.zeros(1, 33), packed, 20, None, None)
    q, d, m = quantized.quantize_q4_1_weight(torch.randn(20, 33))
    packed = torch.ops.rankcast.pack_q4_weight(q, d, m)
    assert torch.equal(torch.ops.rankcast.q4_linear(torch.zeros(2, 33), packed, 20, bias)[1], bias)
    with pytest.raises(RuntimeError, match="whole groups of 32"):
        torch.ops.rankcast.pack_q4_weight(q[:, :33], d, m)
    with pytest.raises(RuntimeError, match="another shape"):
        torch.ops.rankcast.q4_linear(torch.zeros(1, 70), packed, 20, None)
    q8, d8 = quantized.quantize_q8_0_weight(torch.randn(20, 33))
    packed = torch.ops.rankcast.pack_q8_weight(q8, d8)
    assert torch.equal(torch.ops.rankcast.q8_linear(torch.zeros(2, 33), packed, 20, bias)[1], bias)
    with pytest.raises(RuntimeError, match="whole groups of 32"):
        torch.ops.rankcast.pack_q8_weight(q8[:, :33], d8)
    with pytest.raises(RuntimeError, match="float16"):
        torch.ops.rankcast.pack_q8_weight(q8, d8.float())
    with pytest.raises(RuntimeError, match="another shape"):
        torch.ops.rankcast.q8_linear(torch.zeros(1, 70), packed, 20, None)


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_the_torch_path_is_the_reference(scheme: str) -> None:
    """Where the kernels are not built (CUDA too) int8 weights multiply through torch: the
    references (W8A8's with float32 instead of exact sums)."""
    _, values, scales = _quantized(64, 300, seed=11)
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(12))
    fast = quantized.w8a8_linear_reference(x, values, scales, None, exact=False)
    torch.testing.assert_close(fast, quantized.w8a8_linear_reference(x, values, scales, None))
    weight = ops.pack_linear_weight(torch.randn(64, 300), "torch", quantization=scheme)
    assert weight is not None and weight.backend == "torch"
    if scheme in ("q4_0", "q4_1"):
        assert weight.groups is not None and weight.tensor.dtype == torch.uint8
        want = quantized.q4_1_linear_reference(x, weight.tensor, *weight.groups, None)
    elif scheme == "q8_0":
        assert weight.groups is not None and weight.tensor.dtype == torch.int8
        want = quantized.q8_0_linear_reference(x, weight.tensor, *weight.groups, None)
    elif scheme == "w8a8":
        want = quantized.w8a8_linear_reference(x, weight.tensor, weight.scales, None)
    else:
        want = quantized.int8_weight_reference(x, weight.tensor, weight.scales, None)
    torch.testing.assert_close(ops.packed_linear(x, weight, None), want)


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_the_path_for_quantized_weights(scheme: str) -> None:
    both = frozenset({torch.float32, torch.bfloat16})
    vnni = CpuFacts("avx512-bf16", both, frozenset(), "avx512-vnni", True, True)
    absent = CpuFacts("other", frozenset(), frozenset(), "none")
    path = choose_linear_path(torch.bfloat16, CPU, "auto", vnni, quantization=scheme)
    assert path.kernel == "rankcast" and path.batch_invariant
    assert ("avx512-vnni" in path.reason) == (scheme == "w8a8")
    assert choose_linear_path(torch.float32, CPU, "auto", absent, scheme).kernel == "torch"
    cuda = choose_linear_path(torch.float16, torch.device("cuda"), "auto", vnni, scheme)
    assert cuda.kernel == "torch" and not cuda.batch_invariant
    assert choose_linear_path(torch.float32, CPU, "torch", vnni, scheme).kernel == "torch"
    with pytest.raises(ValueError, match=f"onednn has no {scheme}"):
        choose_linear_path(torch.float32, CPU, "onednn", vnni, scheme)
    with pytest.raises(ValueError, match=f"no {scheme} matmul"):
        choose_linear_path(torch.float32, CPU, "rankcast", absent, scheme)


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


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_a_quantized_model_stays_close_to_the_float_one(tmp_path: Path, dtype, scheme) -> None:
    """Bound on the tiny random model: logits within 5 % of the float model's logit range. For
    4-bit groups the model's layers are first made what a Q4_1 file holds (as the embedded
    SmolLM2's are): those are served as they are, and only the 8-bit head differs (4 bits of
    random Gaussian weights would be 16 % off; the real model's cost is the perplexity in
    bench/perplexity.py). 8-bit groups quantize the random weights themselves, head included."""
    model_dir = write_tiny_model(tmp_path / "m", vocab_size=256, seed=3, tie_word_embeddings=False)
    if scheme in ("q4_0", "q4_1"):
        _as_if_from_a_4bit_file(model_dir, scheme)
    prompt = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(0)).tolist()
    want = _logits(_runner(model_dir, dtype, "none"), prompt)
    quantized = _runner(model_dir, dtype, scheme)
    got = _logits(quantized, prompt)
    spread = float(want.max() - want.min())
    assert float((got - want).abs().max()) < 0.05 * spread
    linears = [m for m in quantized.model.modules() if isinstance(m, PackedLinearMixin)]
    assert linears and all(
        m.packed_weight is not None
        and m.packed_weight.quantization == layer_quantization(m, scheme)
        for m in linears
    )
    head = quantized.model.lm_head
    assert head is not None and head.packed_weight is not None
    assert head.packed_weight.quantization == ("q8_0" if scheme in ("q4_0", "q4_1") else scheme)


@pytest.mark.parametrize("scheme", ["none", "q4_1", "q8_0"])
def test_the_start_up_log_names_the_scheme(tmp_path: Path, scheme: str) -> None:
    """What `auto` made of a file is visible: each rank's loader names the scheme it runs."""
    model_dir = write_tiny_model(tmp_path / "m", vocab_size=256)
    with captured("rankcast.model.loader") as log:
        _runner(model_dir, torch.bfloat16, scheme)
    assert "linears run" in log.text
    assert (f"{scheme} weights linears run" in log.text) == (scheme != "none")


def _as_if_from_a_4bit_file(model_dir: Path, scheme: str) -> None:
    """Rewrite the checkpoint's decoder-layer projections as a Q4_1 (or Q4_0) GGUF's
    dequantized weights."""
    from safetensors.torch import load_file, save_file

    four_bit = {"q4_0": quantized.quantize_q4_0_weight, "q4_1": quantized.quantize_q4_1_weight}
    quantize = four_bit[scheme]

    for path in model_dir.glob("*.safetensors"):
        tensors = load_file(str(path))
        for name, tensor in tensors.items():
            if name.startswith("model.layers.") and name.endswith("proj.weight"):
                values, d, m = quantize(tensor)
                out = tensor.shape[0]
                rebuilt = values.view(out, -1, 32).float() * d.float()[..., None]
                rebuilt = rebuilt + m.float()[..., None]
                tensors[name] = rebuilt.view(out, -1)[:, : tensor.shape[1]].to(tensor.dtype)
        save_file(tensors, str(path), metadata={"format": "pt"})


@needs_kernel
@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_the_decoder_stack_runs_quantized_layers_as_the_modules_do(tmp_path: Path, scheme) -> None:
    model_dir = write_tiny_model(tmp_path / "m", vocab_size=256, seed=4, arch="qwen2")
    prompt = list(range(3, 17))
    fused = _runner(model_dir, torch.bfloat16, scheme)
    assert fused.model.fused_layers is not None
    modules = _runner(model_dir, torch.bfloat16, scheme)
    modules.model.fused_layers = None
    assert torch.equal(_logits(fused, prompt), _logits(modules, prompt))


@needs_kernel
@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_a_quantized_snapshot_is_mapped_and_computes_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scheme: str
) -> None:
    """A snapshot holds the int8 values and scales; a float start never maps it (the key holds
    the quantization) and an int8 start maps it."""
    monkeypatch.setenv("RANKCAST_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = write_tiny_model(tmp_path / "m", vocab_size=250, tie_word_embeddings=False)
    args = (model_dir, torch.bfloat16, CPU, None, None, "rankcast")
    snapshot = WeightSnapshot.for_rank(*args, scheme)
    assert snapshot is not None and snapshot != WeightSnapshot.for_rank(*args)
    prompt = list(range(5, 15))
    first = _logits(_runner(model_dir, torch.bfloat16, scheme, weight_snapshots=True), prompt)
    _wait_for_snapshot(snapshot)
    with captured("rankcast.model.loader") as log:
        mapped = _runner(model_dir, torch.bfloat16, scheme, weight_snapshots=True)
    assert f"{MAPPED} {snapshot.path}" in log.text
    assert torch.equal(_logits(mapped, prompt), first)
    plain = WeightSnapshot.for_rank(*args)
    assert plain is not None and not plain.path.exists()


def test_q6_k_rows_unpack_to_the_weights_gguf_dequantizes() -> None:
    """`unpack_q6_k` reads llama.cpp's block layout: d * sc * (q - 32) is gguf's own
    dequantization of the same bytes, every weight exactly."""
    import gguf
    from gguf import quants

    raw = random_q6_k_rows(19, 512, seed=3)
    d, sc, q = quantized.unpack_q6_k(raw)
    assert d.shape == (19, 2) and sc.shape == (19, 32) and q.shape == (19, 512)
    assert int(q.max()) <= 63
    weights = d.float().repeat_interleave(256, 1) * sc.float().repeat_interleave(16, 1)
    weights = weights * (q.float() - 32)
    want = quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType.Q6_K).reshape(19, 512)
    assert torch.equal(weights, torch.from_numpy(want).float())


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_q6_k_kernel_gives_the_reference_alone_or_batched(dtype: torch.dtype) -> None:
    """csrc/gemm_q6k.cpp against `q6_k_linear_reference` (the same integers, float sums in
    another order), with a bias and a last panel of 5 columns; each row's bits the same alone
    as in a batch of 7."""
    if not (kernels.load() and torch.ops.rankcast.q6k_supported()):
        pytest.skip("this build has no Q6_K kernel (AVX-512 builds only)")
    raw = random_q6_k_rows(37, 512, seed=4)
    d, sc, q = quantized.unpack_q6_k(raw)
    packed = torch.ops.rankcast.pack_q6k_weight(raw)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(7, 512, generator=gen).to(dtype)
    bias = torch.randn(37, generator=gen)
    got = torch.ops.rankcast.q6k_linear(x, packed, 37, bias)
    want = quantized.q6_k_linear_reference(x, d, sc, q, bias)
    torch.testing.assert_close(
        got.float(), want.float(), rtol=2e-6 if dtype == torch.float32 else 1e-2, atol=1e-3
    )
    alone = torch.cat(
        [torch.ops.rankcast.q6k_linear(x[i : i + 1], packed, 37, bias) for i in range(7)]
    )
    assert torch.equal(got, alone)
