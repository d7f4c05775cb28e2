"""Build the CPU kernels for this machine through torch's extension tooling (ninja + the C++
compiler torch was built to work with); a no-op when an up-to-date build exists.

    python -m rankcast.kernels.build [--force] [--verbose]

Every source includes ATen, whose headers take about 8 s to parse at -O3, more than most of
our sources take to compile: with GCC the build first precompiles them once (`pch.h` and its
`.gch`, with the exact flags torch's ninja file gives each source) and has every source
include that, which roughly halves a clean build. The `.gch` (~400 MB) is deleted once the
library is linked. Any other compiler builds without it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from rankcast import envs, kernels

# What every source includes first; `kernels.h` and `gemm.h` include the same.
PRECOMPILED_INCLUDES = ("ATen/ATen.h", "ATen/Parallel.h", "torch/library.h")


def build(force: bool = False, verbose: bool = False) -> Path:
    target = kernels.built_library_path()
    if target.exists() and not force:
        return target
    isa = envs.kernels_isa()
    if not kernels.isa_runs_here(isa):
        raise SystemExit(f"RANKCAST_KERNELS_ISA={isa}: this CPU lacks what such a build uses")
    from torch.utils import cpp_extension

    # ninja comes with the virtual environment; put it on PATH even when the venv is not active.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    work = target.parent
    if force and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    cflags = list(kernels.cflags())
    header = _precompile_header(work, cflags)

    def compile_and_link(header: Path | None) -> str:
        # A precompiled header GCC finds unusable fails the build (said below, then built
        # without it) rather than being skipped silently, which would hide a slow build.
        precompiled = [] if header is None else ["-include", str(header), "-Werror=invalid-pch"]
        return str(
            cpp_extension.load(
                name=kernels.LIBRARY_NAME,
                sources=[str(path) for path in kernels.sources()],
                extra_cflags=cflags + precompiled,
                extra_ldflags=list(kernels.LDFLAGS),
                build_directory=str(work),
                is_python_module=False,
                verbose=verbose,
            )
        )

    try:
        built = compile_and_link(header)
    except RuntimeError as error:
        if header is None or "invalid-pch" not in str(error):
            raise
        print("the precompiled header did not match the build's flags; building without it")
        # torch names a second load of the same extension in one process `<name>_v1`.
        built = str(Path(compile_and_link(None)).replace(target))
    finally:
        if header is not None:
            Path(f"{header}.gch").unlink(missing_ok=True)
    print(f"built {built} in {time.perf_counter() - start:.0f} s")
    return Path(built)


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def _precompile_header(work: Path, cflags: list[str]) -> Path | None:
    """`work/pch.h` with its `.gch`, compiled with the flags torch's ninja file will give each
    source (`torch.utils.cpp_extension`'s `_write_ninja_file_to_build_library`: the extension's
    name, its include paths, -fPIC -std=c++20, then ours); None where the compiler is not GCC
    or the header does not compile, so the build goes on without it."""
    from torch.utils import cpp_extension

    try:
        version = subprocess.run(
            [_compiler(), "--version"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    if "Free Software Foundation" not in version:
        return None
    header = work / "pch.h"
    header.write_text("".join(f"#include <{name}>\n" for name in PRECOMPILED_INCLUDES))
    includes = [*cpp_extension.include_paths("cpu"), sysconfig.get_path("include")]
    command = [
        _compiler(),
        f"-DTORCH_EXTENSION_NAME={kernels.LIBRARY_NAME}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        *(flag for path in includes for flag in ("-isystem", path)),
        "-fPIC",
        "-std=c++20",
        *cflags,
        "-x",
        "c++-header",
        str(header),
        "-o",
        f"{header}.gch",
    ]
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0:
        print(f"building without a precompiled header: {run.stderr.strip()[-2000:]}")
        return None
    return header


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    args = parser.parse_args()
    print(build(args.force, args.verbose))


if __name__ == "__main__":
    main()
