"""The `/metrics` series of one API server, under the names routers scrape.

Engine-derived series (running, waiting, KV usage, cache configuration, and everything built
from engine notifications) are set only from what the engine core broadcasts to every API
server, and a late server starts from the engine's snapshot, so every server reports the same
values; the counters among them are views of engine totals (`fleet.ViewCounter`; the expert
counters, too many for the fleet's files, are rendered from the views at each scrape). Request
latency and token series, and notification delivery lag, are counted by each server and summed
over all of them (`fleet.Fleet`), so every server's `/metrics` shows the fleet's totals.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.utils import floatToGoString

from rankcast.api_server.metrics.families import (
    counter,
    declared,
    gauge,
    histogram,
    view_counter,
)
from rankcast.api_server.metrics.fleet import Fleet, register_summed
from rankcast.api_server.metrics.lora_metrics import LoRAMetrics
from rankcast.channel.events import (
    WEIGHTS_LOADED_KEY,
    CustomNotification,
    Notification,
    NotificationsDropped,
    notification_type,
)
from rankcast.channel.lora_events import lora_event_key
from rankcast.channel.snapshot import EngineStateSnapshot
from rankcast.engine_client.engine_views import EngineViews
from rankcast.protocol import SchedulerStats

# A value as prometheus_client writes it (its utils have no annotations).
_spelled: Callable[[float], str] = floatToGoString


def rank_label(rank: int) -> str:
    """The `rank` label: a worker rank, or `engine_core` for the engine's own pending list."""
    return "engine_core" if rank < 0 else str(rank)


# The series each API server counts itself, summed over all of them on every `/metrics`.
SUMMED = (
    "http_requests",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "rankcast:notification_delivery_lag_seconds",
)


class HistogramBatch:
    """One histogram series' observations gathered over a pass of the output loop (one engine
    step's outputs) and written in one go.

    In multiprocess mode every `observe` is two locked writes into a memory-mapped file, and
    the inter-token latency is observed for every streamed token: at 32 streams that was the
    largest cost of the metrics in the API server's per-token path. Gathered per step, the same
    counts and sum are written with one write per bucket hit and one for the sum. The writes go
    through the child's own value objects (prometheus_client has no batched observe), so the
    exposition is exactly what one `observe` per token gives; a test holds the two equal.
    """

    def __init__(self, child: Any) -> None:
        self.child = child
        self.bounds: list[float] = list(child._upper_bounds)  # the last is +Inf
        self.counts = [0] * len(self.bounds)
        self.total = 0.0
        self.pending = False

    def observe(self, seconds: float, count: int = 1) -> None:
        # The first bucket whose bound is >= the value: observe()'s `amount <= bound`.
        self.counts[bisect_left(self.bounds, seconds)] += count
        self.total += seconds * count
        self.pending = True

    def flush(self) -> None:
        if not self.pending:
            return
        buckets = self.child._buckets
        for i, count in enumerate(self.counts):
            if count:
                buckets[i].inc(count)
                self.counts[i] = 0
        self.child._sum.inc(self.total)
        self.total = 0.0
        self.pending = False


@dataclass
class _EngineTotals:
    """What one engine's total-mirroring counters set from its stats showed (prefix-cache
    queries and hits, routing decisions and prefix tokens), and from which incarnation: a
    restarted engine counts from zero again, so its totals are added to what the counters
    showed when it restarted, never set below it."""

    incarnation: int = 0
    base: dict[tuple[str, ...], float] = field(default_factory=dict)
    shown: dict[tuple[str, ...], float] = field(default_factory=dict)

    def show(self, key: tuple[str, ...], value: float) -> float:
        """What the counter named `key` shows for the engine's total `value`."""
        self.shown[key] = self.base.get(key, 0.0) + value
        return self.shown[key]


class ServerMetrics:
    def __init__(
        self, model_name: str, api_server: int = 0, views: EngineViews | None = None
    ) -> None:
        self.model_name = model_name
        self.api_server = str(api_server)
        self.registry = CollectorRegistry()  # what a scrape renders
        own = CollectorRegistry()  # this server's share of the summed series
        self.fleet = Fleet(own, SUMMED)
        register_summed(self.fleet, self.registry)
        self.running = gauge("vllm:num_requests_running", self.registry)
        self.waiting = gauge("vllm:num_requests_waiting", self.registry)
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", self.registry)
        self.cache_config = gauge("vllm:cache_config_info", self.registry)
        self.engine_up = gauge("rankcast:engine_up", self.registry)
        self.preemptions = gauge("vllm:num_preemptions", self.registry)
        # The engine core's own running totals, as broadcast in its stats: a restarted API
        # server does not reset them.
        self.prefix_cache_queries = view_counter(
            self.fleet, "vllm:prefix_cache_queries", self.registry
        )
        self.prefix_cache_hits = view_counter(self.fleet, "vllm:prefix_cache_hits", self.registry)
        # Where API servers' routing sent requests (the engine counts what it was sent, so
        # every API server shows every server's choices), and how right it was.
        self.routing_decisions = view_counter(
            self.fleet, "rankcast:routing_decisions", self.registry
        )
        self.routing_expected = view_counter(
            self.fleet, "rankcast:routing_expected_prefix_tokens", self.registry
        )
        self.routing_hit = view_counter(
            self.fleet, "rankcast:routing_hit_prefix_tokens", self.registry
        )
        # Adapter cache observability: where each adapter's requests found it, and how often a
        # request had to bring back an adapter that was pushed out for another (thrashing).
        self.lora_requests_found = view_counter(
            self.fleet, "rankcast:lora_requests_found", self.registry
        )
        self.lora_evictions_undone = view_counter(
            self.fleet, "rankcast:lora_evictions_undone", self.registry
        )
        # Speculative decoding, as vLLM counts it (the engine's totals, broadcast in its stats).
        self.spec_drafts = view_counter(self.fleet, "vllm:spec_decode_num_drafts", self.registry)
        self.spec_draft_tokens = view_counter(
            self.fleet, "vllm:spec_decode_num_draft_tokens", self.registry
        )
        self.spec_accepted = view_counter(
            self.fleet, "vllm:spec_decode_num_accepted_tokens", self.registry
        )
        self.spec_accepted_per_pos = view_counter(
            self.fleet, "vllm:spec_decode_num_accepted_tokens_per_pos", self.registry
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", own)
        self.generation_tokens = counter("vllm:generation_tokens", own)
        self.request_success = counter("vllm:request_success", own)
        self.http_requests = counter("http_requests", own)
        self.ttft = histogram("vllm:time_to_first_token_seconds", own)
        self.itl = histogram("vllm:inter_token_latency_seconds", own)
        self.itl_batch = HistogramBatch(self.itl.labels(model_name))
        self.e2e = histogram("vllm:e2e_request_latency_seconds", own)
        self.gathers = gauge("rankcast:notification_gathers", self.registry)
        self.gather_seconds = gauge("rankcast:notification_gather_seconds", self.registry)
        self.notifications_total = view_counter(
            self.fleet, "rankcast:engine_notifications", self.registry
        )
        self.notifications_skipped = view_counter(
            self.fleet, "rankcast:engine_notifications_skipped", self.registry
        )
        self.notifications_dropped = view_counter(
            self.fleet, "rankcast:worker_notifications_dropped", self.registry
        )
        self.notification_lag = histogram("rankcast:notification_delivery_lag_seconds", own)
        self.weights_load_seconds = gauge("rankcast:worker_weights_load_seconds", self.registry)
        self.weights_load_bytes = gauge("rankcast:worker_weights_load_bytes", self.registry)
        self.kv_cache_committed = gauge("rankcast:kv_cache_committed_bytes", self.registry)
        self._cache_labels: dict[int, tuple[str, str, str]] = {}
        self._engine_totals: dict[int, _EngineTotals] = {}
        # The LoRA series, when the API server serves adapters (set by the API server).
        self.lora: LoRAMetrics | None = None
        # What the engine-derived series render: the views the API server's output loop keeps.
        self.views = views if views is not None else EngineViews(1)

    def record_scheduler_stats(self, engine_index: int, stats: SchedulerStats) -> None:
        labels = (self.model_name, str(engine_index))
        self.running.labels(*labels).set(stats.num_running_reqs)
        self.waiting.labels(*labels).set(stats.num_waiting_reqs)
        self.kv_usage.labels(*labels).set(stats.kv_cache_usage)
        self.preemptions.labels(*labels).set(stats.num_preemptions)
        totals = self._engine_totals.setdefault(engine_index, _EngineTotals())
        queries = totals.show(("queries",), stats.prefix_cache_queries)
        self.prefix_cache_queries.set(labels, queries)
        self.prefix_cache_hits.set(labels, totals.show(("hits",), stats.prefix_cache_hits))
        engine = (str(engine_index),)
        for reason, count in stats.routing_decisions.items():
            shown = totals.show(("routed", reason), count)
            self.routing_decisions.set((*engine, reason), shown)
        expected = totals.show(("expected",), stats.routing_expected_prefix_tokens)
        self.routing_expected.set(engine, expected)
        self.routing_hit.set(engine, totals.show(("found",), stats.routing_hit_prefix_tokens))
        for adapter, found in stats.lora_requests_found.items():
            for tier, count in found.items():
                shown = totals.show(("adapter", adapter, tier), count)
                self.lora_requests_found.set((*engine, adapter, tier), shown)
        for adapter, count in stats.lora_evictions_undone.items():
            shown = totals.show(("undone", adapter), count)
            self.lora_evictions_undone.set((*engine, adapter), shown)
        if stats.spec_decode_num_drafts:
            self.spec_drafts.set(labels, totals.show(("drafts",), stats.spec_decode_num_drafts))
            drafted = totals.show(("drafted",), stats.spec_decode_num_draft_tokens)
            self.spec_draft_tokens.set(labels, drafted)
            accepted = totals.show(("accepted",), stats.spec_decode_num_accepted_tokens)
            self.spec_accepted.set(labels, accepted)
            for position, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
                shown = totals.show(("accepted_at", str(position)), count)
                self.spec_accepted_per_pos.set((*labels, str(position)), shown)
        self.kv_cache_committed.labels(*labels).set(stats.kv_cache_committed_bytes)
        self.gathers.labels(str(engine_index)).set(stats.notification_gathers)
        self.gather_seconds.labels(str(engine_index)).set(stats.notification_gather_seconds)
        config = (str(stats.block_size), stats.kv_cache_dtype, str(stats.num_blocks))
        if self._cache_labels.get(engine_index) != config:
            previous = self._cache_labels.get(engine_index)
            if previous is not None:
                self.cache_config.remove(*labels, *previous)
            self.cache_config.labels(*labels, *config).set(1)
            self._cache_labels[engine_index] = config

    def record_engine_up(self, engine_index: int, up: bool) -> None:
        """A dead engine runs nothing, queues nothing and holds no cache: say so at once, so a
        router does not send traffic by load that no longer exists."""
        self.engine_up.labels(str(engine_index)).set(1 if up else 0)
        if not up:
            labels = (self.model_name, str(engine_index))
            self.running.labels(*labels).set(0)
            self.waiting.labels(*labels).set(0)
            self.kv_usage.labels(*labels).set(0)

    def record_first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model_name).observe(seconds)

    def record_inter_token(self, seconds: float, tokens: int) -> None:
        """Gathered until `record_step_end`: see `HistogramBatch`."""
        self.itl_batch.observe(seconds, tokens)

    def record_step_end(self) -> None:
        self.itl_batch.flush()

    def record_finished(
        self,
        engine_index: int,
        e2e_seconds: float,
        prompt_tokens: int,
        generation_tokens: int,
        finish_reason: str,
    ) -> None:
        self.e2e.labels(self.model_name).observe(e2e_seconds)
        self.prompt_tokens.labels(self.model_name).inc(prompt_tokens)
        self.generation_tokens.labels(self.model_name).inc(generation_tokens)
        self.request_success.labels(self.model_name, str(engine_index), finish_reason).inc()

    def record_http_request(self, method: str, status: str, handler: str) -> None:
        """One HTTP request answered (`middleware.CountRequests` says how it is labelled)."""
        self.http_requests.labels(method, status, handler).inc()

    # ---- engine state, rendered from the views (a NotificationSink) ----

    def apply_snapshot(self, snapshot: EngineStateSnapshot) -> None:
        """The engine's view started over from its snapshot: show every series of it again. A
        new incarnation's stats totals (from zero again) count on from what was shown."""
        engine = snapshot.engine_index
        totals = self._engine_totals.setdefault(engine, _EngineTotals())
        if snapshot.incarnation != totals.incarnation:
            totals.incarnation, totals.base = snapshot.incarnation, dict(totals.shown)
        view = self.views[engine]
        self._show_totals(view.totals, view.skipped)
        for rank in view.dropped:
            self._show_dropped(engine, rank)
        for rank, payload in view.weights_loaded.items():
            self._record_weights(str(engine), rank, payload)
        if self.lora is not None:
            self.lora.refresh(engine, None)

    def consume(
        self, engine: int, notifications: list[Notification], unknown: list[str], now: float
    ) -> None:
        """A batch the views have applied: show what it changed, and its delivery lag."""
        lag = self.notification_lag.labels(self.api_server)
        touched: set[tuple[str, str]] = set()
        lora_keys: set[tuple[str, str, str]] = set()
        for n in notifications:
            touched.add((notification_type(n), n.key if isinstance(n, CustomNotification) else ""))
            lag.observe(max(0.0, now - n.timestamp))
            if isinstance(n, NotificationsDropped):
                self._show_dropped(n.engine_index, n.rank)
            elif isinstance(n, CustomNotification) and n.key == WEIGHTS_LOADED_KEY:
                loaded = self.views[engine].weights_loaded.get(n.rank, {})
                self._record_weights(str(engine), n.rank, loaded)
            key = lora_event_key(n)
            if key is not None:
                lora_keys.add(key)
        touched.update((kind, "") for kind in unknown)
        self._show_totals(touched, set(unknown))
        if self.lora is not None and lora_keys:  # loads come only with LoRA events
            self.lora.refresh(engine, lora_keys)

    def _show_totals(self, keys: Iterable[tuple[str, str]], skipped: Iterable[str]) -> None:
        pairs = list(zip(self.views.views, self.views.earlier, strict=True))
        for key in keys:
            total = sum(v.totals.get(key, 0) + e.totals.get(key, 0) for v, e in pairs)
            self.notifications_total.set(key, total)
        for kind in skipped:
            total = sum(v.skipped.get(kind, 0) + e.skipped.get(kind, 0) for v, e in pairs)
            self.notifications_skipped.set((kind,), total)

    def _show_dropped(self, engine: int, rank: int) -> None:
        if not 0 <= engine < len(self.views):
            return
        count = self.views[engine].dropped.get(rank, 0) + self.views.earlier[engine].dropped.get(
            rank, 0
        )
        self.notifications_dropped.set((str(engine), rank_label(rank)), count)

    def _record_weights(self, engine: str, rank: int, payload: dict[str, Any]) -> None:
        labels = (engine, rank_label(rank))
        if isinstance(payload.get("seconds"), int | float):
            self.weights_load_seconds.labels(*labels).set(payload["seconds"])
        if isinstance(payload.get("bytes"), int | float):
            self.weights_load_bytes.labels(*labels).set(payload["bytes"])

    def exposition(self) -> bytes:
        self.fleet.read()
        return generate_latest(self.registry) + self._expert_tokens()

    def _expert_tokens(self) -> bytes:
        """`rankcast:moe_expert_tokens_total`, rendered from this server's views at each scrape,
        as the Rust server renders it, and not through the fleet's files like the other engine
        totals: a large mixture of experts has tens of thousands of these series (Qwen3-30B-A3B
        at TP=2: 12,288), which prometheus_client's files took ~45 ms of each second to write and
        ~300 ms a scrape to merge and render. So each server shows its own view of the totals
        (every server has the same once an event reached them all: milliseconds)."""
        family = declared("rankcast:moe_expert_tokens")
        samples = [
            ((str(engine), rank_label(rank), str(layer), str(expert)), count)
            for engine in range(len(self.views))
            for (rank, layer), tokens in self.views.expert_tokens(engine).items()
            for expert, count in enumerate(tokens)
        ]
        samples.sort()  # by label values in the declared order, as the engine totals are
        escaped = family.help.replace("\\", r"\\").replace("\n", r"\n")
        lines = [f"# HELP {family.name} {escaped}\n# TYPE {family.name} counter\n"]
        lines.extend(
            f'{family.name}{{engine="{engine}",expert="{expert}",layer="{layer}",rank="{rank}"}}'
            f" {_spelled(count)}\n"
            for (engine, rank, layer, expert), count in samples
        )
        return "".join(lines).encode()
