"""LoRA series of one API server, under the names routers read (DESIGN.md section 4).

Residency (`vllm:lora_adapter_loaded` and the counts) is read at scrape time from the
`LoRAResidency` state that lifecycle events and the engine's snapshot keep, so a series
disappears the moment its eviction arrives. Event counts and load times start from the
snapshot's totals, so a late API server reports what its siblings report.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from rankcast.api_server.metrics.fleet import Fleet, ViewCounter
from rankcast.api_server.metrics.lora_residency import LoRAResidency
from rankcast.channel.events import Notification
from rankcast.channel.lora_events import lora_event_key, lora_load_time
from rankcast.channel.snapshot import EngineStateSnapshot
from rankcast.protocol import SchedulerStats

_LOAD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# The metric's `level` label: vLLM calls the device tier "gpu" whatever the device is.
_LEVEL = {"device": "gpu", "cpu": "cpu"}


class _ResidencyCollector(Collector):
    def __init__(self, metrics: LoRAMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        m, residency = self.metrics, self.metrics.residency
        if not residency.max_loras:
            return  # the engine serves no adapters (no LoRA section in its snapshot)
        loaded = GaugeMetricFamily(
            "vllm:lora_adapter_loaded",
            "1 while the adapter is resident on the rank (series removed on eviction).",
            labels=["adapter_name", "level", "pinned", "rank", "model_name", "engine"],
        )
        counts: dict[str, set[tuple[int, str]]] = {"gpu": set(), "cpu": set()}
        for engine, adapters in sorted(residency.adapters.items()):
            for name, state in sorted(adapters.items()):
                for rank, tiers in sorted(state.ranks.items()):
                    pinned = "true" if rank in state.pinned else "false"
                    for tier in sorted(tiers):
                        level = _LEVEL.get(tier, tier)
                        counts.setdefault(level, set()).add((engine, name))
                        labels = [name, level, pinned, str(rank), m.model_name, str(engine)]
                        loaded.add_metric(labels, 1)
        yield loaded
        for level in ("gpu", "cpu"):
            gauge = GaugeMetricFamily(
                f"vllm:num_{level}_loaded_lora_adapters",
                f"Adapters resident in the {level} tier (per engine, counted once).",
                labels=["model_name"],
            )
            gauge.add_metric([m.model_name], len(counts[level]))
            yield gauge
        slots = GaugeMetricFamily(
            "vllm:max_gpu_lora_adapters",
            "Adapter slots per rank (--max-loras).",
            labels=["model_name"],
        )
        slots.add_metric([m.model_name], residency.max_loras)
        yield slots
        partial = GaugeMetricFamily(
            "rankcast:lora_adapter_partial",
            "1 when the ranks of an engine that holds the adapter disagree on where it is.",
            labels=["adapter_name"],
        )
        for adapter in residency.describe():
            partial.add_metric([adapter["name"]], 1 if adapter["partial"] else 0)
        yield partial
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Adapters of running and of waiting requests; value: unix time of the last change.",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        running = ",".join(residency.running_adapters())
        waiting = ",".join(residency.waiting_adapters())
        info.add_metric([str(residency.max_loras), running, waiting], residency.requests_changed_at)
        yield info


class LoRAMetrics:
    """A NotificationSink and scheduler-stats consumer that owns the LoRA series."""

    def __init__(
        self, registry: CollectorRegistry, fleet: Fleet, model_name: str, residency: LoRAResidency
    ) -> None:
        self.model_name = model_name
        self.residency = residency
        self.events = ViewCounter(
            fleet,
            "rankcast:lora_adapter_events",
            "Adapter lifecycle events from every rank, by adapter, event and reason.",
            ["adapter_name", "event", "reason"],
            registry,
        )
        self.load_seconds = Histogram(
            "vllm:lora_adapter_load_seconds",
            "Seconds a rank took to move an adapter, per transition (one per rank per move).",
            ["transition"],
            buckets=_LOAD_BUCKETS,
            registry=registry,
        )
        registry.register(_ResidencyCollector(self))

    def apply_snapshot(self, snapshot: EngineStateSnapshot) -> None:
        if snapshot.lora is None:
            return
        for c in snapshot.lora.events:
            self.events.inc((c.adapter, c.event, c.reason), c.count)
        for load in snapshot.lora.loads:
            self.load_seconds.labels(load.transition).observe(load.seconds)

    def consume(self, notifications: list[Notification], unknown: list[str], now: float) -> None:
        for n in notifications:
            key = lora_event_key(n)
            if key is not None:
                self.events.inc(key)
            load = lora_load_time(n)
            if load is not None:
                self.load_seconds.labels(load[0]).observe(load[1])

    def record_scheduler_stats(self, engine_index: int, stats: SchedulerStats) -> None:
        self.residency.record_scheduler_stats(engine_index, stats)
