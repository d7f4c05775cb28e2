"""The Python API server's `/metrics` families are the ones tests/fixtures/metrics/families.json
declares (name, type, labels, help, source); the Rust server is held to the same file by its own
test (rust/frontend/src/metrics_spec.rs), so a family added or changed on one side only fails."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from tests.fixtures.metrics.generate import SPEC, parse_exposition, python_families


def test_the_python_servers_families_are_the_declared_ones() -> None:
    declared = {f["name"]: f for f in json.loads(SPEC.read_text())}
    exposed = {
        f.name: {k: v for k, v in asdict(f).items() if k != "samples"} for f in python_families()
    }
    missing, extra = sorted(set(declared) - set(exposed)), sorted(set(exposed) - set(declared))
    assert not missing and not extra, (
        f"declared but not exposed: {missing}; exposed but not declared: {extra} "
        "(rewrite the spec on purpose: .venv/bin/python tests/fixtures/metrics/generate.py)"
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
