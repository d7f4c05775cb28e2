"""The one function that chooses each linear's matmul path, for every x86 family the machines
may be (docs/cpu-paths.md): the families this machine is not are stated through their facts,
and the machine's own family through its real probes."""

from __future__ import annotations

import pytest
import torch

from rankcast import kernels
from rankcast.config import ConfigError, ParallelConfig
from rankcast.model.linear_kernels import CpuFacts, LinearPath, choose_linear_path, cpu_family

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
    for dtype in (F32, BF16):
        assert choose_linear_path(dtype, CPU).kernel == "rankcast"


def test_a_bad_setting_stops_the_engine_at_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANKCAST_LINEAR_KERNEL", "mkl")
    with pytest.raises(ConfigError, match="RANKCAST_LINEAR_KERNEL must be"):
        ParallelConfig()
    monkeypatch.setenv("RANKCAST_LINEAR_KERNEL", "OneDNN")
    assert ParallelConfig().linear_kernel == "onednn"
