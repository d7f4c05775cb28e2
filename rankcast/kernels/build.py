"""Build the CPU kernels for this machine through torch's extension tooling (ninja + the C++
compiler torch was built to work with); a no-op when an up-to-date build exists.

    python -m rankcast.kernels.build [--force] [--verbose]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

from rankcast import envs, kernels


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
    built = cpp_extension.load(
        name=kernels.LIBRARY_NAME,
        sources=[str(path) for path in kernels.sources()],
        extra_cflags=list(kernels.cflags()),
        extra_ldflags=list(kernels.LDFLAGS),
        build_directory=str(work),
        is_python_module=False,
        verbose=verbose,
    )
    print(f"built {built} in {time.perf_counter() - start:.0f} s")
    return Path(str(built))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    args = parser.parse_args()
    print(build(args.force, args.verbose))


if __name__ == "__main__":
    main()
