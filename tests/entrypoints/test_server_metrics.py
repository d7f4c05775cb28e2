"""The inter-token latency histogram, gathered per engine step, reads exactly as one
`observe` per token would have written it; requests are counted by route as vLLM counts them."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from rankcast.api_server.metrics.families import declared
from rankcast.api_server.metrics.prometheus import ServerMetrics
from rankcast.api_server.middleware import CountRequests, LastResortErrors, TagAndAuthenticate
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


def test_requests_are_counted_by_method_status_class_and_route_template() -> None:
    """`http_requests_total{method,status,handler}` as vLLM's API server labels it: the route
    template (one series for every value of a path parameter), the status class, "none" for a
    path no route matched and for a request refused before any route ran (the API key); a
    stream once it ended; an exception as the 500 it became; the probes not at all."""
    metrics = ServerMetrics("m")
    app = FastAPI()
    app.add_middleware(LastResortErrors)
    app.add_middleware(TagAndAuthenticate, index=0, api_key="key")
    app.add_middleware(CountRequests, metrics=metrics)

    @app.get("/v1/things/{thing_id}")
    async def thing(thing_id: str) -> dict[str, str]:
        return {"id": thing_id}

    @app.post("/v1/stream")
    async def stream() -> StreamingResponse:
        return StreamingResponse(iter([b"a", b"b"]))

    @app.get("/v1/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    @app.get("/metrics")
    async def scrape() -> bytes:
        return metrics.exposition()

    async def send() -> None:
        key = {"authorization": "Bearer key"}
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            for thing_id in ("a", "b", "c"):
                assert (await http.get(f"/v1/things/{thing_id}", headers=key)).status_code == 200
            assert (await http.post("/v1/stream", headers=key)).content == b"ab"
            assert (await http.get("/v1/things/a")).status_code == 401
            assert (await http.get("/v1/nowhere/1", headers=key)).status_code == 404
            assert (await http.get("/v1/boom", headers=key)).status_code == 500
            assert (await http.get("/metrics")).status_code == 200

    asyncio.run(send())
    counted = sorted(
        line
        for line in metrics.exposition().decode().splitlines()
        if line.startswith("http_requests_total{")
    )
    assert counted == [
        'http_requests_total{handler="/v1/boom",method="GET",status="5xx"} 1.0',
        'http_requests_total{handler="/v1/stream",method="POST",status="2xx"} 1.0',
        'http_requests_total{handler="/v1/things/{thing_id}",method="GET",status="2xx"} 3.0',
        'http_requests_total{handler="none",method="GET",status="4xx"} 2.0',
    ]


def test_expert_counters_catch_up_and_count_on_across_an_engine_restart() -> None:
    """`rankcast:moe_expert_tokens_total` from the ranks' expert-load events: a late API server
    started from the engine's snapshot shows the same series; a restarted engine's loads add to
    what was shown, never back; a payload of another shape under the key changes nothing."""
    from rankcast.channel.events import CustomNotification
    from rankcast.channel.expert_load import EXPERT_LOAD_KEY, expert_load_payloads
    from rankcast.channel.snapshot import EngineStateSnapshot
    from rankcast.engine_client.engine_views import EngineViews

    def load(rank: int, rows: list[list[int]], seq: int) -> CustomNotification:
        payload = expert_load_payloads([0, 2], rows, 1, 0.5)[0]
        return CustomNotification(
            key=EXPERT_LOAD_KEY, payload=payload, engine_index=0, rank=rank, engine_seq=seq
        )

    def server(snapshot: EngineStateSnapshot) -> tuple[EngineViews, ServerMetrics]:
        views = EngineViews(1)
        metrics = ServerMetrics("m", 0, views)
        views.apply_snapshot(snapshot)
        metrics.apply_snapshot(snapshot)
        return views, metrics

    def feed(views: EngineViews, metrics: ServerMetrics, events: list[CustomNotification]) -> None:
        views.consume(0, list(events), [])
        metrics.consume(0, list(events), [], now=0.0)

    def experts(metrics: ServerMetrics) -> dict[str, float]:
        lines = metrics.exposition().decode().splitlines()
        prefix = "rankcast:moe_expert_tokens_total{"
        samples = (line.split(" ") for line in lines if line.startswith(prefix))
        return {name: float(value) for name, value in samples}

    def series(rank: int, layer: int, expert: int) -> str:
        labels = f'engine="0",expert="{expert}",layer="{layer}",rank="{rank}"'
        return f"rankcast:moe_expert_tokens_total{{{labels}}}"

    views, metrics = server(EngineStateSnapshot(engine_index=0, incarnation=0))
    feed(views, metrics, [load(0, [[3, 1], [0, 4]], 0), load(1, [[3, 1], [0, 4]], 1)])
    bad = CustomNotification(
        key=EXPERT_LOAD_KEY, payload={"layers": [0], "tokens": [[-1, 1]]}, engine_index=0, rank=0
    )
    feed(views, metrics, [load(0, [[1, 1], [2, 0]], 2), bad])
    shown = experts(metrics)
    assert len(shown) == 8
    assert shown[series(0, 0, 0)] == 4 and shown[series(0, 2, 1)] == 4
    assert shown[series(1, 0, 0)] == 3 and shown[series(1, 2, 0)] == 0
    _, late = server(views[0].state())
    assert experts(late) == shown
    # The engine restarts: its next incarnation counts from none.
    views.apply_snapshot(EngineStateSnapshot(engine_index=0, incarnation=1))
    metrics.apply_snapshot(EngineStateSnapshot(engine_index=0, incarnation=1))
    assert experts(metrics) == shown
    feed(views, metrics, [load(1, [[1, 0], [0, 2]], 0)])
    after = experts(metrics)
    assert after[series(1, 0, 0)] == 4 and after[series(1, 2, 1)] == 6
    assert all(after[name] >= count for name, count in shown.items())
