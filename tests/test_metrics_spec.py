"""The Python API server's `/metrics` families are the ones declared in
rankcast/api_server/metrics/families.json (name, type, labels in order, help, source), the file
both servers build their families from; the Rust server is held to it by its own test
(rust/frontend/src/metrics_spec.rs)."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from tests.fixtures.metrics.generate import SPEC, parse_exposition, python_families


def test_the_python_servers_families_are_the_declared_ones() -> None:
    # Label names compared as sets: a fleet's merged exposition writes them in name order,
    # while the declaration lists them in the order the code gives their values.
    declared = {
        f["name"]: {**{k: v for k, v in f.items() if k != "buckets"}, "labels": sorted(f["labels"])}
        for f in json.loads(SPEC.read_text())
    }
    exposed = {
        f.name: {
            **{k: v for k, v in asdict(f).items() if k != "samples"},
            "labels": sorted(f.labels),
        }
        for f in python_families()
    }
    missing, extra = sorted(set(declared) - set(exposed)), sorted(set(exposed) - set(declared))
    assert not missing and not extra, (
        f"declared but not exposed: {missing}; exposed but not declared: {extra} "
        "(the differences: .venv/bin/python tests/fixtures/metrics/generate.py)"
    )
    for name, family in declared.items():
        assert exposed[name] == family, name


def test_the_exposition_parser_reads_families_labels_and_skips_created() -> None:
    text = (
        "# HELP a_total Things.\n# TYPE a_total counter\n"
        'a_total{x="1",y="q\\"uote"} 2.0\na_created{x="1",y="2"} 1.7e+09\n'
        "# HELP h Seconds.\n# TYPE h histogram\n"
        'h_bucket{le="0.1",m="a"} 1.0\nh_count{m="a"} 1.0\nh_sum{m="a"} 0.05\n'
        "# HELP g Empty.\n# TYPE g gauge\n"
    )
    families = parse_exposition(text)
    assert {n: (f.type, f.labels, f.samples) for n, f in families.items()} == {
        "a_total": ("counter", ["x", "y"], 1),
        "h": ("histogram", ["m"], 3),
        "g": ("gauge", [], 0),
    }
    with pytest.raises(AssertionError, match="samples labelled"):
        parse_exposition('# HELP b B.\n# TYPE b gauge\nb{x="1"} 1.0\nb{y="1"} 1.0\n')


def test_the_values_fixture_is_how_prometheus_client_and_msgspec_write_them() -> None:
    """tests/fixtures/metrics/values.txt, the spellings the Rust server is held to in its
    expositions and its event JSON (rust/frontend/src/exposition.rs), is what the installed
    prometheus_client and msgspec write for each double, so both kinds of API server render a
    fleet's sums and stream its events alike (rewrite it on purpose:
    .venv/bin/python tests/fixtures/metrics/values.py)."""
    import struct

    from tests.fixtures.metrics.values import VALUES, spellings

    lines = VALUES.read_text().splitlines()
    assert len(lines) > 4000
    for line in lines:
        bits, text = line.split(" ", 1)
        value = struct.unpack("<d", struct.pack("<Q", int(bits, 16)))[0]
        assert spellings(value) == text, line


def test_every_histogram_is_declared_with_its_buckets_and_built_with_them() -> None:
    from prometheus_client import CollectorRegistry

    from rankcast.api_server.metrics.families import FAMILIES, histogram

    histograms = [f for f in FAMILIES.values() if f.type == "histogram"]
    assert histograms and all(f.buckets == tuple(sorted(f.buckets)) for f in histograms)
    for family in histograms:
        built = histogram(family.base, CollectorRegistry())
        assert tuple(built._upper_bounds[:-1]) == family.buckets, family.name
