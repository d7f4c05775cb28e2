"""The mutation catalogue stays applicable: each mutant's original text occurs exactly once in
its file, and each names test files that exist. `make mutants` (not part of `make test`) would
otherwise find out only after minutes, and a module moved or reworded would silently drop the
rule it guards from the mutation check."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.mutation.mutants import MUTANTS, Mutant

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_each_mutant_applies_to_its_file_and_names_real_tests(mutant: Mutant) -> None:
    source = (REPO / mutant.path).read_text()
    assert source.count(mutant.original) == 1, f"{mutant.path}: {mutant.original!r}"
    assert mutant.mutated != mutant.original
    for test in mutant.tests:
        assert (REPO / test.split("::")[0]).is_file(), test


def test_the_names_are_unique() -> None:
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names))
