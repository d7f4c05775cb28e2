"""LoRA series of one API server, under the names routers read (DESIGN.md section 4), rendered
from the engine views (`rankcast/engine_client/engine_views.py`); nothing here counts events.

Residency (`vllm:lora_adapter_loaded` and the counts) is read from the views at scrape time, so a
series disappears the moment its eviction arrives. The event counter and the load-time histogram
follow the views' counts as each batch arrives (`refresh`): the counter shows every engine's
total (earlier incarnations included), the histogram observes each load the views applied once.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from rankcast.api_server.metrics.families import gauge_family, histogram, view_counter
from rankcast.api_server.metrics.fleet import Fleet
from rankcast.engine_client.engine_views import EngineViews

# The metric's `level` label: vLLM calls the device tier "gpu" whatever the device is.
_LEVEL = {"device": "gpu", "cpu": "cpu"}


class _ResidencyCollector(Collector):
    def __init__(self, metrics: LoRAMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        m, views = self.metrics, self.metrics.views
        if not views.serves_adapters():
            return  # the engine serves no adapters (no LoRA section in its snapshot)
        loaded = gauge_family("vllm:lora_adapter_loaded")
        counts: dict[str, set[tuple[int, str]]] = {"gpu": set(), "cpu": set()}
        for view in views.views:
            engine = view.engine_index
            for name, adapter in sorted(view.adapters.items()):
                for rank, tiers in sorted(adapter.ranks.items()):
                    pinned = "true" if rank in adapter.pinned else "false"
                    for tier in sorted(tiers):
                        level = _LEVEL.get(tier, tier)
                        counts.setdefault(level, set()).add((engine, name))
                        labels = [name, level, pinned, str(rank), m.model_name, str(engine)]
                        loaded.add_metric(labels, 1)
        yield loaded
        for level in ("gpu", "cpu"):
            gauge = gauge_family(f"vllm:num_{level}_loaded_lora_adapters")
            gauge.add_metric([m.model_name], len(counts[level]))
            yield gauge
        slots = gauge_family("vllm:max_gpu_lora_adapters")
        slots.add_metric([m.model_name], views.max_loras)
        yield slots
        partial = gauge_family("rankcast:lora_adapter_partial")
        for name in views.adapter_names():
            held_partly = any(view.partial(name) for view in views.views)
            partial.add_metric([name], 1 if held_partly else 0)
        yield partial
        info = gauge_family("vllm:lora_requests_info")
        running = ",".join(views.running_adapters())
        waiting = ",".join(views.waiting_adapters())
        info.add_metric([str(views.max_loras), running, waiting], views.requests_changed_at)
        yield info


class LoRAMetrics:
    """The LoRA series, rendered from the engine views."""

    def __init__(
        self, registry: CollectorRegistry, fleet: Fleet, model_name: str, views: EngineViews
    ) -> None:
        self.model_name = model_name
        self.views = views
        self.events = view_counter(fleet, "rankcast:lora_adapter_events", registry)
        self.load_seconds = histogram("vllm:lora_adapter_load_seconds", registry)
        # Per engine, how many of its view's loads the histogram has observed.
        self.loads_observed = [0] * len(views)
        registry.register(_ResidencyCollector(self))

    def refresh(self, engine: int, keys: Iterable[tuple[str, str, str]] | None) -> None:
        """Follow what `engine`'s view now counts: after a batch, the event keys it touched;
        after a snapshot (None), every key, and the loads it started from."""
        view = self.views[engine]
        if keys is None:
            self.loads_observed[engine] = 0
            keys = list(view.lora_events)
        new = min(view.loads_applied - self.loads_observed[engine], len(view.loads))
        if new > 0:
            for transition, seconds in itertools.islice(view.loads, len(view.loads) - new, None):
                self.load_seconds.labels(transition).observe(seconds)
        self.loads_observed[engine] = view.loads_applied
        for key in keys:
            self.events.set(key, self._total(key))

    def _total(self, key: tuple[str, str, str]) -> float:
        return sum(
            view.lora_events.get(key, 0) + earlier.lora_events.get(key, 0)
            for view, earlier in zip(self.views.views, self.views.earlier, strict=True)
        )
