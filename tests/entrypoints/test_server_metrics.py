"""The inter-token latency histogram, gathered per engine step, reads exactly as one
`observe` per token would have written it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from rankcast.api_server.metrics.families import declared
from rankcast.api_server.metrics.prometheus import ServerMetrics
from tests.entrypoints.notification_clients import prefix_cache_totals

ITL = "vllm:inter_token_latency_seconds"


def _itl_lines(text: str) -> list[str]:
    """The histogram's samples (its creation time differs between any two registries)."""
    return [
        line
        for line in text.splitlines()
        if line.startswith(ITL) and not line.startswith(f"{ITL}_created")
    ]


def test_a_step_of_inter_token_latencies_reads_as_one_observe_per_token() -> None:
    metrics = ServerMetrics("m")
    registry = CollectorRegistry()
    reference = Histogram(
        ITL, "reference", ["model_name"], buckets=declared(ITL).buckets, registry=registry
    )
    # On bounds (a value equal to a bound counts in that bucket), between them, zero, past the
    # last bound, several tokens at once (a step that produced more than one), an empty step.
    steps = [[(0.02, 1), (0.0, 3), (0.019, 1)], [(0.3, 2), (7.5, 1)], [], [(0.005, 1)]]
    for step in steps:
        for seconds, tokens in step:
            metrics.record_inter_token(seconds, tokens)
            for _ in range(tokens):
                reference.labels("m").observe(seconds)
        metrics.record_step_end()
        ours = _itl_lines(metrics.exposition().decode())
        assert ours == _itl_lines(generate_latest(registry).decode())
    assert f'{ITL}_count{{model_name="m"}} 9.0' in ours
    assert f'{ITL}_bucket{{le="0.02",model_name="m"}} 6.0' in ours


def test_nothing_is_written_until_the_step_ends() -> None:
    metrics = ServerMetrics("m")
    metrics.record_inter_token(0.01, 4)
    assert f'{ITL}_count{{model_name="m"}} 0.0' in _itl_lines(metrics.exposition().decode())
    metrics.record_step_end()
    assert f'{ITL}_count{{model_name="m"}} 4.0' in _itl_lines(metrics.exposition().decode())


def _prefix_cache(metrics: ServerMetrics) -> tuple[float, float]:
    return prefix_cache_totals(metrics.exposition().decode())


def test_engine_totals_count_on_across_an_engine_restart_never_back() -> None:
    """A restarted engine's stats count from zero again; the counters that mirror its totals
    add them to what they showed, so no counter goes backwards (a rate() reads no reset)."""
    from rankcast.channel.snapshot import EngineStateSnapshot
    from rankcast.protocol import SchedulerStats

    def stats(queries: int = 0, hits: int = 0) -> SchedulerStats:
        return SchedulerStats(prefix_cache_queries=queries, prefix_cache_hits=hits)

    metrics = ServerMetrics("m")
    metrics.apply_snapshot(EngineStateSnapshot(engine_index=0, incarnation=0))
    metrics.record_scheduler_stats(0, stats(100, 40))
    assert _prefix_cache(metrics) == (100, 40)
    # The same incarnation again (a reconnect): nothing to add.
    metrics.apply_snapshot(EngineStateSnapshot(engine_index=0, incarnation=0))
    metrics.record_scheduler_stats(0, stats(120, 50))
    assert _prefix_cache(metrics) == (120, 50)
    metrics.apply_snapshot(EngineStateSnapshot(engine_index=0, incarnation=1))
    metrics.record_scheduler_stats(0, stats(5, 1))
    assert _prefix_cache(metrics) == (125, 51)
    metrics.apply_snapshot(EngineStateSnapshot(engine_index=0, incarnation=2))
    metrics.record_scheduler_stats(0, stats())
    assert _prefix_cache(metrics) == (125, 51)
