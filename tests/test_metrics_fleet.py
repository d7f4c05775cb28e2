"""The fleet's summed series: every API server merges the shared .db files the same way."""

from __future__ import annotations

import glob
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.mmap_dict import MmapedDict, mmap_key

from rankcast.api_server.metrics.fleet import MULTIPROC_DIR_ENV, Fleet


def test_files_are_merged_in_name_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Float sums depend on their order: 1e16 - 1e16 + 1 is 1, but 1 - 1e16 + 1e16 is 0 (the
    1 is lost against 1e16). The directory is listed here in reverse name order (the order a
    directory gives is the file system's to choose); the fleet still sums in name order, as the
    Rust API server does (its `read_directory` test), so a fleet's servers render one value,
    not two a ulp apart."""
    key = mmap_key("x", "x_total", [], [], "a counter")
    for name, value in (("counter_a.db", 1e16), ("counter_b.db", -1e16), ("counter_c.db", 1.0)):
        db = MmapedDict(str(tmp_path / name))
        db.write_value(key, value, 0.0)
        db.close()
    listed = glob.glob
    monkeypatch.setattr(glob, "glob", lambda pattern: sorted(listed(pattern), reverse=True))
    monkeypatch.setenv(MULTIPROC_DIR_ENV, str(tmp_path))
    fleet = Fleet(CollectorRegistry(), ["x"])
    fleet.read()
    (family,) = fleet.summed_families()
    assert [sample.value for sample in family.samples] == [1.0]
