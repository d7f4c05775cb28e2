"""The page renders the engine view and nothing else: random views (from the same strategy over
real event types that the Python and Rust views are replayed with, tests/test_engine_view.py)
rendered by the page's own `residencyGrid` in a real headless Chromium must show, cell for cell,
each rank's tier, its pin and the engine's partial residency as the view has them; and by its
`expertHeatMaps`, each engine's tokens per (MoE layer, expert) summed over its ranks, with the
share of the layer's tokens each cell is coloured by.

The page is served as the package ships it, by a plain static file server (its API calls go
unanswered here: the served page's end-to-end checks are test_dashboard_browser.py's)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rankcast.api_server import dashboard
from rankcast.channel.view import add_counts
from tests.dashboard.browser import chromium, find_chromium, wait_for
from tests.entrypoints.server_process import free_port
from tests.test_engine_view import view_states

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

_FOUND = find_chromium()
pytestmark = pytest.mark.skipif(isinstance(_FOUND, str), reason=str(_FOUND))

READ_GRID = """
return residencyGrid(arguments[0]).rows.map((tr) => [
  tr.dataset.adapter,
  [...tr.querySelectorAll("td.cell")].map((c) => [
    Number(c.dataset.engine), Number(c.dataset.rank), c.dataset.tier,
    c.classList.contains("pinned"), c.classList.contains("partial"),
  ]),
  tr.lastElementChild.textContent,
]);
"""


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebDriver]:
    """The page in Chromium, served from the package's own files under /dashboard/."""
    port = free_port()
    root = tmp_path_factory.mktemp("site")
    (root / "dashboard").symlink_to(dashboard.__path__[0])
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _answers(f"{url}/dashboard/index.html"), 20, "the static server")
        with chromium() as browser:
            browser.get(f"{url}/dashboard/index.html")
            wait_for(
                lambda: browser.execute_script("return typeof residencyGrid === 'function'"),
                20,
                "the page's script",
            )
            yield browser
    finally:
        server.terminate()
        server.wait(timeout=10)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def expected_grid(views: list[dict[str, Any]]) -> list[list[Any]]:
    """What the grid must show for these views, straight from their fields."""
    columns = [
        (view["engine"], rank)
        for view in views
        if view["lora"] is not None
        for rank in range(view["lora"]["world_size"])
    ]
    on_engine: dict[str, dict[int, dict[str, Any]]] = {}
    for view in views:
        for adapter in (view["lora"] or {}).get("adapters", []):
            on_engine.setdefault(adapter["name"], {})[view["engine"]] = adapter
    rows = []
    for name in sorted(on_engine):
        cells = []
        for engine, rank in columns:
            entry = on_engine[name].get(engine)
            here = next((r for r in (entry or {}).get("ranks", []) if r["rank"] == rank), None)
            tiers = here["tiers"] if here else []
            tier = "device" if "device" in tiers else "cpu" if "cpu" in tiers else ""
            pinned = bool(here and here["pinned"])
            cells.append([engine, rank, tier, pinned, bool(entry and entry["partial"])])
        entries = on_engine[name].values()
        flags = [
            flag
            for flag, key in (("running", "running_requests"), ("waiting", "waiting_requests"))
            if sum(e[key] for e in entries)
        ]
        rows.append([name, cells, ", ".join(flags) or "-"])
    return rows


READ_HEAT_MAPS = """
return expertHeatMaps(arguments[0]).map((table) => [
  Number(table.dataset.engine),
  [...table.querySelectorAll("tr[data-layer]")].map((tr) => [
    Number(tr.dataset.layer),
    [...tr.querySelectorAll("td.heat-cell")].map((c) => [
      Number(c.dataset.tokens), Number(c.dataset.share)]),
  ]),
]);
"""


def expected_heat_maps(views: list[dict[str, Any]]) -> list[list[Any]]:
    """What the heat maps must show for these views: per engine that reports expert load, its
    layers in order, each expert's tokens over the engine's ranks and share of the layer's."""
    maps = []
    for view in views:
        layers: dict[int, list[int]] = {}
        for row in view["experts"]:
            add_counts(layers.setdefault(row["layer"], []), row["tokens"])
        if not layers:
            continue
        width = max(len(tokens) for tokens in layers.values())
        rows = []
        for layer, tokens in sorted(layers.items()):
            tokens = tokens + [0] * (width - len(tokens))
            total = sum(tokens)
            rows.append([layer, [[count, count / total if total else 0] for count in tokens]])
        maps.append([view["engine"], rows])
    return maps


def _two_engines(first: dict[str, Any], second: dict[str, Any] | None) -> list[dict[str, Any]]:
    views = [first]
    if second is not None:
        views.append({**second, "engine": 1})
    return views


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.builds(_two_engines, view_states, st.none() | view_states))
def test_the_page_renders_each_view_as_it_is(page: WebDriver, views: list[dict[str, Any]]) -> None:
    assert page.execute_script(READ_GRID, views) == expected_grid(views)
    assert page.execute_script(READ_HEAT_MAPS, views) == expected_heat_maps(views)


def test_the_golden_expert_loads_show_as_each_layers_share_by_expert(page: WebDriver) -> None:
    """The golden stream's two ranks, summed: layer 2's expert 1 took 7 of its 18 tokens."""
    import json

    from tests.fixtures.view.generate import HERE

    view = json.loads((HERE / "lora_tp2.json").read_text())
    ((engine, rows),) = page.execute_script(READ_HEAT_MAPS, [view])
    assert engine == 0 and [layer for layer, _ in rows] == [0, 2]
    assert rows[1][1][1] == [7, 7 / 18]
    assert page.execute_script(READ_HEAT_MAPS, [{**view, "experts": []}]) == []


def test_a_pinned_adapter_evicted_from_the_host_tier_shows_nothing_on_that_rank(
    page: WebDriver,
) -> None:
    """The case the page once got wrong, from the golden stream: rank 1 of "sql" lost its host
    tier and its pin (the page kept both), rank 0 its device slot but not its pin."""
    import json

    from tests.fixtures.view.generate import HERE

    view = json.loads((HERE / "lora_tp2.json").read_text())
    grid = page.execute_script(READ_GRID, [view])
    sql = next(row for row in grid if row[0] == "sql")
    assert sql[1] == [[0, 0, "cpu", True, True], [0, 1, "", False, True]]
