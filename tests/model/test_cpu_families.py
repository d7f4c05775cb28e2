"""The kernel builds other CPU families get, built and tested on this one.

A machine of a newer family also runs the instructions of the older ones, so the kernels are
built again without this CPU's newer instructions (`RANKCAST_KERNELS_ISA`, one build each, keyed
apart) and the matmul, attention and batch-invariance tests run on that build in a process of
their own (a process loads one kernel library). A Zen 4/5 or Xeon tests the AVX-512 without BF16
family (Skylake-SP to Ice Lake) and the AVX2 one (Zen 2/3, Haswell); a Zen 3 only its own; an AMX
Xeon also the AVX512-BF16 one (Zen 4/5), which its own build replaces by tiles for bfloat16
(docs/cpu-paths.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from rankcast import kernels
from tests import kernel_family_builds

ROOT = Path(__file__).resolve().parents[2]
# What each family's build must pass: the kernels against torch and their bitwise properties,
# the decoder against transformers, and the model-level invariance properties on the tiny model
# (a verification step's rows included: speculative decoding is exact on every family's path).
TESTS = [
    "tests/model/test_ops.py",
    "tests/model/test_kv_cache_dtype.py::test_the_kernel_writes_the_bytes_and_scales_torch_writes",
    "tests/model/test_kv_cache_dtype.py::test_paged_attention_reads_an_8bit_cache_as_torch_does",
    "tests/model/test_kv_cache_dtype.py::test_a_token_gets_the_same_bits_alone_batched_split_or_in_a_prompt",
    "tests/model/test_quantized_linears.py",
    "tests/model/test_llama_logits.py",
    "tests/model/test_batch_invariance.py::test_the_tiny_models_logits_do_not_depend_on_the_batch",
    "tests/model/test_batch_invariance.py::test_a_verification_step_gives_each_draft_the_logits_of_its_own_decode",
    "tests/model/test_moe.py::test_a_tokens_output_does_not_depend_on_who_shares_its_experts",
    "tests/model/test_moe.py::test_the_fused_block_gives_the_loops_bits_and_counts",
]


@pytest.mark.parametrize("isa", ["avx512-bf16", "avx512", "avx2"])
def test_another_familys_build_passes_the_kernel_tests_here(isa: str) -> None:
    if not kernels.isa_runs_here(isa):
        pytest.skip(f"this CPU cannot run a {isa} build")
    if not kernel_family_builds.needed_here(isa):
        pytest.skip("without AMX this CPU's own build is the avx512-bf16 one")
    env = {**os.environ, "RANKCAST_KERNELS_ISA": isa, "RANKCAST_KERNELS": "require"}
    # Started in the background when the suite collected this test (tests/conftest.py).
    status, output = kernel_family_builds.finish(isa)
    assert status == 0, output
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch; from rankcast import kernels; kernels.load(); "
            "print(torch.ops.rankcast.build_isa(), torch.ops.rankcast.w8a8_path())",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    # The W8A8 kernel of each family: VNNI where it has it, else VPMADDWD on zmm (Skylake-SP) or
    # ymm (AVX2).
    w8a8 = {"avx512-bf16": "avx512-vnni", "avx512": "avx512bw", "avx2": "avx2"}[isa]
    assert probe.stdout.split() == [isa, w8a8], probe.stdout + probe.stderr
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout


def _build_isa_loaded(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch; from rankcast import kernels; kernels.load(); "
            "print(torch.ops.rankcast.build_isa())",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_named_kernels_build_is_loaded_instead_of_this_checkouts() -> None:
    """RANKCAST_KERNELS_LIBRARY, with which bench/decode_step.py times two builds against each
    other: the process loads the named build (here the AVX2 family's, which says so), and a
    path that is not there is an error naming the setting, not a silent fallback."""
    if not kernels.isa_runs_here("avx2"):
        pytest.skip("this CPU cannot run an avx2 build")
    status, output = kernel_family_builds.finish("avx2")
    assert status == 0, output
    library = output.strip().splitlines()[-1]
    assert Path(library).is_file(), output
    env = {k: v for k, v in os.environ.items() if k != "RANKCAST_KERNELS_ISA"}
    loaded = _build_isa_loaded({**env, "RANKCAST_KERNELS_LIBRARY": library})
    assert loaded.stdout.split() == ["avx2"], loaded.stdout + loaded.stderr
    missing = _build_isa_loaded({**env, "RANKCAST_KERNELS_LIBRARY": f"{library}.missing"})
    assert missing.returncode != 0
    assert (
        "RANKCAST_KERNELS_LIBRARY" in missing.stderr and ".missing: no such file" in missing.stderr
    )


def test_a_decodes_read_ahead_follows_the_cpu_vendor() -> None:
    """Intel builds read a decode's weights ahead with PREFETCHT0, AMD's non-temporally (each
    measured faster on its own vendor's CPUs: docs/cpu-paths.md); both fetch a decode's next
    column group into L2, the default (measured faster on a Zen 4 and a Sapphire Rapids Xeon);
    a batch's next group goes into L1 on AMD (the default) and into L2 on Intel. Intel's
    AVX512-BF16 builds do VDPBF16PS's products on FMAs (slow there, as fast as them on AMD).
    The flags are among the build's compiler flags, so they are part of the build's key as
    well."""
    intel = kernels.cflags("native", "GenuineIntel")
    amd = kernels.cflags("native", "AuthenticAMD")
    assert "-DRANKCAST_DECODE_PREFETCH_LOCALITY=3" in intel
    assert "-DRANKCAST_BATCH_NEXT_LOCALITY=1" in intel
    assert "-DRANKCAST_BF16_PAIRS_ON_FMA=1" in intel
    assert not any("DECODE_NEXT_LOCALITY" in flag for flag in intel)
    assert not any("LOCALITY" in flag or "PAIRS_ON_FMA" in flag for flag in amd)
    assert kernels.cflags("avx2", "GenuineIntel")[-3:] == (
        "-DRANKCAST_DECODE_PREFETCH_LOCALITY=3",
        "-DRANKCAST_BATCH_NEXT_LOCALITY=1",
        "-DRANKCAST_BF16_PAIRS_ON_FMA=1",
    )
    assert kernels.cflags() == kernels.cflags(vendor=kernels.cpu_vendor())


def test_the_amx_tile_code_compiles_for_an_amx_cpu_on_any_machine() -> None:
    """The tile kernel (csrc/gemm_amx.cpp) is compiled only where -march=native has AMX, so a
    machine without it would never notice the code broken (gemm.cpp's branch into it is built
    by every AVX512-BF16 build). It is compiled here for Sapphire Rapids (checked, not run: this
    CPU may lack the tiles), after the preprocessor says that target does take the tile path."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    includes.append(f"-I{sysconfig.get_paths()['include']}")
    command = [compiler, "-std=c++20", "-march=sapphirerapids", "-fopenmp", *includes]
    path = str(kernels.SOURCE_DIR / "gemm_amx.cpp")
    macros = subprocess.run(
        [*command, "-dM", "-E", path], capture_output=True, text=True, timeout=120
    )
    if macros.returncode != 0 and "sapphirerapids" in macros.stderr:
        pytest.skip(f"{compiler} does not know -march=sapphirerapids")
    assert macros.returncode == 0, macros.stderr[-3000:]
    assert "#define RANKCAST_AMX_BF16 1" in macros.stdout
    checked = subprocess.run(
        [*command, "-fsyntax-only", "-Wall", path], capture_output=True, text=True, timeout=300
    )
    assert checked.returncode == 0, checked.stderr[-3000:]
    assert "warning" not in checked.stderr, checked.stderr[-3000:]
