"""Series that read the same whichever API server a scrape lands on.

Several API servers share one port, so consecutive scrapes of one target reach different
processes; a counter that each kept for itself would jump between their values, and Prometheus
reads every drop as a reset (every `rate()` wrong). Two kinds of series need care:

- What each API server counts itself (tokens, request outcomes, latency histograms, delivery
  lag): summed over every API server with prometheus_client's multiprocess mode, as vLLM does
  with several API servers. The launcher gives all of them one directory
  (`PROMETHEUS_MULTIPROC_DIR`); each process writes its values there, and every scrape adds up
  all of them, a restarted server's predecessor included, so the sums never go back.
- Its view of an engine total (events by type, prefix-cache hits, adapter events): every server
  follows the same broadcast, but not in the same microsecond. Each writes its view; a scrape
  shows the furthest view of any server (the maximum), which only grows and is equal on every
  server once they have caught up.

Without the directory (one API server started by hand, tests of one process) both kinds are this
process's own values, which is the same thing.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
_VIEW_SUFFIX = "_view"


def multiprocess_dir() -> str | None:
    """The shared directory, when this process writes its values there (set before
    prometheus_client is imported: the launcher puts it in the API servers' environment)."""
    return os.environ.get(MULTIPROC_DIR_ENV) or None


class Fleet:
    """What every API server wrote, read once per scrape."""

    def __init__(self, own: CollectorRegistry, summed: Iterable[str]) -> None:
        self.directory = multiprocess_dir()
        self.own = own  # this process's summed series (all there is without the directory)
        self.summed = frozenset(summed)
        self.families: dict[str, Metric] = {}

    def read(self) -> None:
        """Take every process's current values; a scrape calls this before it collects."""
        if self.directory is None:
            return
        # Files merged in name order, as the Rust API server merges them: float sums taken in
        # another order (directory order may differ between two reads) can end 1 ulp apart,
        # and every server of a fleet must render the same value.
        files = sorted(glob.glob(os.path.join(self.directory, "*.db")))
        # prometheus_client's multiprocess module has no annotations.
        merge: Any = MultiProcessCollector.merge
        merged: Iterable[Metric] = merge(files, accumulate=True)
        self.families = {family.name: family for family in merged}

    def summed_families(self) -> Iterator[Metric]:
        if self.directory is None:
            yield from self.own.collect()
            return
        for name in sorted(self.summed):
            family = self.families.get(name)
            if family is not None:
                yield family


class _SummedCollector:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[Metric]:
        return self.fleet.summed_families()


def register_summed(fleet: Fleet, registry: CollectorRegistry) -> None:
    """Expose the summed series through `registry` (the one a scrape renders)."""
    registry.register(_SummedCollector(fleet))


class ViewCounter:
    """A counter whose value is this server's view of an engine total; exposed as the furthest
    view of any API server (see the module docstring)."""

    def __init__(
        self,
        fleet: Fleet,
        name: str,
        documentation: str,
        labelnames: list[str],
        registry: CollectorRegistry,
    ) -> None:
        self.fleet = fleet
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self.values: dict[tuple[str, ...], float] = {}
        self._written: Gauge | None = None
        if fleet.directory is not None:
            self._written = Gauge(
                name + _VIEW_SUFFIX,
                documentation,
                labelnames,
                multiprocess_mode="max",
                registry=None,
            )
        registry.register(self)

    def inc(self, labels: tuple[str, ...], amount: float = 1.0) -> None:
        self.set(labels, self.values.get(labels, 0.0) + amount)

    def set(self, labels: tuple[str, ...], value: float) -> None:
        self.values[labels] = value
        if self._written is not None:
            self._written.labels(*labels).set(value)

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        values = self.values
        written = self.fleet.families.get(self.name + _VIEW_SUFFIX)
        if self._written is not None and written is not None:
            values = {
                tuple(sample.labels[label] for label in self.labelnames): sample.value
                for sample in written.samples
            }
        for labels, value in sorted(values.items()):
            family.add_metric(list(labels), value)
        yield family
