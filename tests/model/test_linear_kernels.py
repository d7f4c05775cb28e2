"""The one function that chooses each linear's matmul path, for every x86 family the machines
may be (docs/cpu-paths.md): the families this machine is not are stated through their facts,
and the machine's own family through its real probes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rankcast import envs, kernels
from rankcast.config import ConfigError, ParallelConfig
from rankcast.model.linear_kernels import (
    ROWS_SPLIT,
    CpuFacts,
    LinearPath,
    choose_linear_path,
    cpu_family,
)
from rankcast.model.llama import LlamaForCausalLM
from rankcast.model.loader import load_model
from rankcast.model_files.arch import ArchConfig
from rankcast.protocol import ScheduledSequence, SchedulerOutput
from rankcast.worker.model_runner import ModelRunner
from tests.conftest import write_tiny_model

F32, BF16 = torch.float32, torch.bfloat16
CPU = torch.device("cpu")
BOTH = frozenset({F32, BF16})

# What each family's kernel build and oneDNN can do (gemm.cpp's `gemm_supported`; oneDNN packs
# bfloat16 only with AVX-512 or AVX-NE-CONVERT).
FAMILIES = {
    "amx": CpuFacts("amx", packed=BOTH, onednn=BOTH),
    "avx512-bf16": CpuFacts("avx512-bf16", packed=BOTH, onednn=BOTH),
    "avx512": CpuFacts("avx512", packed=BOTH, onednn=BOTH),
    "avx2": CpuFacts("avx2", packed=BOTH, onednn=frozenset({F32})),
    "kernels-off": CpuFacts("avx2", packed=frozenset(), onednn=frozenset({F32})),
}


@pytest.mark.parametrize("family", ["amx", "avx512-bf16", "avx512", "avx2"])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_auto_takes_rankcasts_batch_invariant_kernel_on_every_x86_family(
    family: str, dtype: torch.dtype
) -> None:
    """AMX included: one kernel for every batch size, so results do not depend on the batch,
    snapshots hold its layout and the C++ decoder stack runs."""
    path = choose_linear_path(dtype, CPU, "auto", FAMILIES[family])
    assert path.kernel == "rankcast" and path.batch_invariant


def test_an_amx_build_names_its_tiles_for_bfloat16_and_its_dot_products_for_float32() -> None:
    """The start-up log says which kernel family a linear runs: an AMX build multiplies
    bfloat16 (and int8 weights under bfloat16 rows) on tiles (every row count), float32 on the
    FMA kernel; the same CPU with a build narrowed to AVX512-BF16 (RANKCAST_KERNELS_ISA) names
    no tiles."""
    amx_build = CpuFacts("amx", packed=BOTH, onednn=BOTH, build="amx")
    tiles = choose_linear_path(BF16, CPU, "auto", amx_build)
    assert tiles.kernel == "rankcast" and tiles.batch_invariant
    assert "AMX tiles at every row count" in tiles.reason
    assert "AMX tiles" not in choose_linear_path(F32, CPU, "auto", amx_build).reason
    narrowed = CpuFacts("amx", packed=BOTH, onednn=BOTH, build="avx512-bf16")
    assert "AMX tiles" not in choose_linear_path(BF16, CPU, "auto", narrowed).reason
    forced = choose_linear_path(BF16, CPU, "rankcast", amx_build)
    assert forced.reason.startswith("forced by RANKCAST_LINEAR_KERNEL; AMX tiles")
    # Weight-only int8 under bfloat16 activations takes the tiles too; under float32, FMAs.
    int8_tiles = choose_linear_path(BF16, CPU, "auto", amx_build, quantization="int8")
    assert int8_tiles.batch_invariant and "converted to bfloat16" in int8_tiles.reason
    assert "AMX tiles at every row count" in int8_tiles.reason
    int8_f32 = choose_linear_path(F32, CPU, "auto", amx_build, quantization="int8")
    assert "AMX tiles" not in int8_f32.reason and "widened in registers" in int8_f32.reason
    int8_narrowed = choose_linear_path(BF16, CPU, "auto", narrowed, quantization="int8")
    assert "AMX tiles" not in int8_narrowed.reason


def test_without_the_kernels_float32_goes_to_onednn_and_bfloat16_to_plain_torch() -> None:
    facts = FAMILIES["kernels-off"]
    assert choose_linear_path(F32, CPU, "auto", facts) == LinearPath(
        "onednn", False, "no packed float32 kernel in this build"
    )
    assert choose_linear_path(BF16, CPU, "auto", facts).kernel == "torch"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_forced_path_is_taken_where_it_runs_and_refused_by_name_where_not(family: str) -> None:
    facts = FAMILIES[family]
    for dtype in (F32, BF16):
        for kernel, able in (("rankcast", facts.packed), ("onednn", facts.onednn)):
            if dtype in able:
                path = choose_linear_path(dtype, CPU, kernel, facts)
                assert path.kernel == kernel and path.batch_invariant == (kernel == "rankcast")
            else:
                with pytest.raises(ValueError, match=f"RANKCAST_LINEAR_KERNEL={kernel}"):
                    choose_linear_path(dtype, CPU, kernel, facts)
        assert choose_linear_path(dtype, CPU, "torch", facts).kernel == "torch"


def test_other_devices_and_dtypes_run_f_linear_and_refuse_a_cpu_kernel() -> None:
    facts = FAMILIES["amx"]
    assert choose_linear_path(torch.float16, CPU, "auto", facts).kernel == "torch"
    assert choose_linear_path(BF16, torch.device("cuda"), "auto", facts).kernel == "torch"
    with pytest.raises(ValueError, match="CPU in float32 or bfloat16 only"):
        choose_linear_path(BF16, torch.device("cuda"), "rankcast", facts)


@pytest.mark.parametrize(
    "flags,family",
    [
        ("fma avx2 avx512f avx512bw avx512_bf16 amx_tile amx_bf16 amx_int8", "amx"),
        ("fma avx2 avx512f avx512bw avx512_bf16 avx512_vnni", "avx512-bf16"),
        ("fma avx2 avx512f avx512bw avx512_vnni", "avx512"),
        ("fma avx2 avx_vnni", "avx2"),
        ("sse4_2 avx", "other"),
    ],
)
def test_the_family_is_read_from_the_cpu_flags(flags: str, family: str) -> None:
    assert cpu_family(frozenset(flags.split())) == family


def test_this_machine_takes_the_path_its_family_row_says() -> None:
    """The real probes agree with the table: the kernels are built here (make test builds
    them), so this machine's family takes rankcast's kernel for float32 and bfloat16."""
    facts = CpuFacts.of_this_machine()
    assert kernels.load()
    if facts.family == "other":
        pytest.skip("not an x86 CPU with AVX2 and FMA")
    assert facts.packed == BOTH
    assert facts.build == torch.ops.rankcast.build_isa()
    if facts.family == "amx" and envs.kernels_isa() == "native":
        # The tiles really run here: a build whose tiles the OS refused would fall back to
        # VDPBF16PS silently, and every other test would still pass on it.
        assert facts.build == "amx"
    for dtype in (F32, BF16):
        assert choose_linear_path(dtype, CPU).kernel == "rankcast"


def test_a_bad_setting_stops_the_engine_at_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANKCAST_LINEAR_KERNEL", "mkl")
    with pytest.raises(ConfigError, match="RANKCAST_LINEAR_KERNEL must be"):
        ParallelConfig()
    monkeypatch.setenv("RANKCAST_LINEAR_KERNEL", "OneDNN")
    assert ParallelConfig().linear_kernel == "onednn"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rows_is_taken_where_both_matmuls_pack_the_dtype_and_refused_by_name_elsewhere(
    family: str,
) -> None:
    """`rows` keeps both packings and picks by the step's rows, so it needs both: AMX and the
    AVX-512 families for either dtype, AVX2 for float32 only (oneDNN packs no bfloat16 there),
    nothing without the kernels; never batch-invariant, never for quantized weights."""
    facts = FAMILIES[family]
    for dtype in (F32, BF16):
        if dtype in facts.packed and dtype in facts.onednn:
            path = choose_linear_path(dtype, CPU, "rows", facts)
            assert path.kernel == "rows" and not path.batch_invariant
            assert f"below {ROWS_SPLIT} rows" in path.reason
        else:
            with pytest.raises(ValueError, match="RANKCAST_LINEAR_KERNEL=rows needs both"):
                choose_linear_path(dtype, CPU, "rows", facts)
    with pytest.raises(ValueError, match="RANKCAST_LINEAR_KERNEL=rows has no q4_1 path"):
        choose_linear_path(BF16, CPU, "rows", facts, quantization="q4_1")


def _tiny_step(
    model_dir: Path, kernel: str, rows: int
) -> tuple[torch.Tensor, set[str], LlamaForCausalLM]:
    """One decode step of `rows` sequences after a 5-token prompt each, under the linear path
    `kernel`: its logits, the names of the ops it ran (torch.profiler: the stack's kernels name
    their ranges), and the model."""
    arch = ArchConfig.from_model_dir(model_dir)
    model = load_model(model_dir, arch, BF16, CPU, linear_kernel=kernel)
    runner = ModelRunner(model, arch, 4, CPU, BF16)
    runner.initialize_cache(4 * (rows + 1) + 4)
    prompt = [5, 17, 200, 42, 9]
    tables = [[2 * b + 1, 2 * b + 2] for b in range(rows)]
    runner.compute_logits(SchedulerOutput([ScheduledSequence("r", prompt, 0, t) for t in tables]))
    step = [ScheduledSequence("r", [7 + b], len(prompt), t) for b, t in enumerate(tables)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        logits = runner.compute_logits(SchedulerOutput(step))
    return logits, {event.key for event in profile.key_averages()}, model


def test_rows_runs_rankcasts_kernel_for_few_rows_and_onednns_for_many(tmp_path: Path) -> None:
    """On a real model: a step below ROWS_SPLIT rows runs the C++ decoder stack on rankcast's
    kernel (its bits), a step of ROWS_SPLIT rows or more runs every linear through oneDNN (its
    bits), and neither touches the other's matmul."""
    facts = CpuFacts.of_this_machine()
    if BF16 not in facts.packed or BF16 not in facts.onednn:
        pytest.skip("this CPU lacks one of the two bfloat16 matmuls")
    model_dir = write_tiny_model(tmp_path / "m", vocab_size=256, seed=3)
    few, many = ROWS_SPLIT - 1, ROWS_SPLIT + 1
    got, ran, model = _tiny_step(model_dir, "rows", few)
    assert model.fused_layers is not None and model.fused_max_rows == ROWS_SPLIT
    assert "rankcast::packed_linear[qkv]" in ran and ONEDNN_OP not in ran
    assert torch.equal(got, _tiny_step(model_dir, "rankcast", few)[0])
    got, ran, _ = _tiny_step(model_dir, "rows", many)
    assert ONEDNN_OP in ran and not any(name.startswith("rankcast::packed_linear") for name in ran)
    assert torch.equal(got, _tiny_step(model_dir, "onednn", many)[0])


ONEDNN_OP = "mkldnn::_linear_pointwise"
