"""Apply each mutant of tests/mutation/mutants.py, run only the tests mapped to it, revert.

A mutant is CAUGHT when its tests fail, SURVIVED when they pass: a survivor names a rule no test
would notice breaking. The source is restored after every mutant, whatever happens (Ctrl-C
included). Not part of `make test`: it runs the mapped tests once per mutant (about ten minutes
on 2 cores).

    python -m tests.mutation.run [--only NAME ...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from tests.mutation.mutants import MUTANTS, Mutant

ROOT = Path(__file__).resolve().parents[2]


def apply_and_test(mutant: Mutant, timeout_s: float) -> tuple[bool, float]:
    """(caught, seconds)."""
    source = ROOT / mutant.path
    original = source.read_text()
    found = original.count(mutant.original)
    if found != 1:
        raise SystemExit(f"{mutant.name}: its original text occurs {found} times in {mutant.path}")
    start = time.perf_counter()
    try:
        source.write_text(original.replace(mutant.original, mutant.mutated))
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
        done = subprocess.run(
            [*command, *mutant.tests], cwd=ROOT, capture_output=True, timeout=timeout_s
        )
        caught = done.returncode != 0
    except subprocess.TimeoutExpired:
        caught = True  # a hang is a failure the tests would report
    finally:
        source.write_text(original)
    return caught, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", nargs="*", default=None, help="mutant names to run")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per mutant")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if args.only is None or m.name in args.only]
    survivors = []
    for mutant in chosen:
        caught, seconds = apply_and_test(mutant, args.timeout)
        verdict = "CAUGHT" if caught else "SURVIVED"
        print(f"{verdict:<9}{mutant.name:<32}{seconds:>6.0f} s  {mutant.rule}", flush=True)
        if not caught:
            survivors.append(mutant.name)
    print(f"\n{len(chosen) - len(survivors)} of {len(chosen)} mutants caught")
    if survivors:
        raise SystemExit(f"survived: {', '.join(survivors)}")


if __name__ == "__main__":
    main()
