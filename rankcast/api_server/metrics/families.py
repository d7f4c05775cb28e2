"""Every `/metrics` family, declared once in `families.json` beside this file: the name as
exposed, type, label names in the order their values are given, help text, histogram buckets,
and where the values come from ("engine": what the engine core sends every API server, the
same on each; "fleet": what each API server counts itself, summed over all of them).

Both kinds of API server build their families from that file: this module for the Python one,
`rust/frontend/src/families.rs` (which compiles the same file in) for the Rust one. A new family
is one entry there and the code that sets its value; a help text or a label renamed in one
place changes both servers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from rankcast.api_server.metrics.fleet import Fleet, ViewCounter


@dataclass(frozen=True)
class Family:
    name: str  # as exposed (a counter's with `_total`)
    type: str
    labels: list[str]
    help: str
    source: str
    buckets: tuple[float, ...] = ()

    @property
    def base(self) -> str:
        """The name prometheus_client is given (it adds a counter's `_total` itself)."""
        return self.name.removesuffix("_total") if self.type == "counter" else self.name


def _load() -> dict[str, Family]:
    rows: list[dict[str, Any]] = json.loads(
        resources.files(__package__).joinpath("families.json").read_text()
    )
    families = {}
    for row in rows:
        family = Family(**{**row, "buckets": tuple(row.get("buckets", ()))})
        families[family.base] = family
    return families


FAMILIES = _load()


def declared(name: str) -> Family:
    """The declaration of a family by the name the code uses (a counter's without `_total`);
    KeyError names a family the file does not declare."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(
            f"{name} is not declared in rankcast/api_server/metrics/families.json"
        ) from None


def gauge(name: str, registry: CollectorRegistry, **kwargs: Any) -> Gauge:
    f = declared(name)
    return Gauge(f.base, f.help, f.labels, registry=registry, **kwargs)


def counter(name: str, registry: CollectorRegistry) -> Counter:
    f = declared(name)
    return Counter(f.base, f.help, f.labels, registry=registry)


def histogram(name: str, registry: CollectorRegistry) -> Histogram:
    f = declared(name)
    return Histogram(f.base, f.help, f.labels, buckets=f.buckets, registry=registry)


def gauge_family(name: str) -> GaugeMetricFamily:
    """An empty family for a collector that renders the gauge's samples at scrape time."""
    f = declared(name)
    return GaugeMetricFamily(f.base, f.help, labels=f.labels)


def view_counter(fleet: Fleet, name: str, registry: CollectorRegistry) -> ViewCounter:
    f = declared(name)
    return ViewCounter(fleet, f.base, f.help, f.labels, registry)
