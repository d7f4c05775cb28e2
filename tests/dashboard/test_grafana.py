"""The Grafana dashboard (docs/grafana/rankcast.json) and the browser page ask only for series
`/metrics` exposes, with labels those series have: both are checked against
rankcast/api_server/metrics/families.json, the declaration both servers build their families
from and are held to (tests/test_metrics_spec.py, rust/frontend's metrics_spec)."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "docs" / "grafana" / "rankcast.json"
PAGE_SCRIPT = ROOT / "rankcast" / "api_server" / "dashboard" / "dashboard.js"
SPEC = ROOT / "rankcast" / "api_server" / "metrics" / "families.json"

_SERIES = re.compile(r"\b((?:vllm|rankcast):[a-zA-Z0-9_:]+)")
_BY = re.compile(r"\bby \(([^)]*)\)")
_MATCHER = re.compile(r"([a-zA-Z0-9_:]+)\{([^}]*)\}")
_MATCHED_LABEL = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")


def exposed() -> dict[str, set[str]]:
    """Every sample name /metrics exposes -> the label names its samples carry."""
    samples: dict[str, set[str]] = {}
    for family in json.loads(SPEC.read_text()):
        labels = set(family["labels"])
        if family["type"] == "histogram":
            samples[family["name"] + "_bucket"] = labels | {"le"}
            samples[family["name"] + "_sum"] = labels
            samples[family["name"] + "_count"] = labels
        else:
            samples[family["name"]] = labels
    return samples


def queries() -> list[str]:
    dashboard = json.loads(GRAFANA.read_text())
    found = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    found += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return found


def test_every_grafana_query_asks_for_exposed_series_by_their_labels() -> None:
    series = exposed()
    checked = 0
    for query in queries():
        names = _SERIES.findall(query)
        assert names, f"a query that reads no rankcast series: {query}"
        for name in names:
            assert name in series, f"{name} is not exposed by /metrics (in: {query})"
        labels = set().union(*(series[n] for n in names))
        for group in _BY.findall(query):
            for label in filter(None, (x.strip() for x in group.split(","))):
                assert label in labels, f"`by ({label})` names no label of {names}: {query}"
        for name, matchers in _MATCHER.findall(query):
            for label in _MATCHED_LABEL.findall(matchers):
                assert label in series.get(name, set()), f"{name} has no label {label}: {query}"
        checked += 1
    assert checked >= 25, "the dashboard lost its panels"


def test_the_grafana_dashboard_covers_each_kind_of_series() -> None:
    """Load, cache, latency, routing, adapters and the channel each have a panel."""
    asked = {name for query in queries() for name in _SERIES.findall(query)}
    for wanted in (
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "rankcast:routing_decisions_total",
        "rankcast:routing_hit_prefix_tokens_total",
        "vllm:lora_adapter_loaded",
        "rankcast:lora_requests_found_total",
        "rankcast:lora_evictions_undone_total",
        "rankcast:engine_notifications_total",
        "rankcast:worker_notifications_dropped_total",
    ):
        assert wanted in asked, f"no panel reads {wanted}"


def test_the_page_reads_only_exposed_series() -> None:
    series = exposed()
    names = set(_SERIES.findall(PAGE_SCRIPT.read_text()))
    assert len(names) >= 12, names  # the residency grid reads /v1/engine_views, not series
    for name in names:
        assert name in series or name + "_bucket" in series, f"the page reads {name}"
