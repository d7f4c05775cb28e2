"""The dashboard in a real headless Chromium, on a real fleet: the tiny model on two ranks (TP=2),
two API servers behind one port, an API key, LoRA with runtime loading, and the test producer in
every rank. Several tabs are opened until both API servers feed one (each page shows which server
its event stream comes from); every check below holds on each of them.

Steps of one session, in file order: the key gate, an adapter load reaching both servers' pages
within a second of the event, an event burst's drop marker, and the engine core killed: shown
down, then back under its next incarnation; killed again while one page is off the network, whose
resumed stream then shows what the dead incarnation never sent as a gap."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.dashboard.browser import chromium, find_chromium, wait_for, wait_for_stream
from tests.entrypoints.notification_clients import producer_server_args
from tests.entrypoints.server_process import TCP_LISTEN, ServerProcess, sockets_on_port

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

pytestmark = pytest.mark.scenario

KEY = "dashboard-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
BUFFER = 16
SERVERS = 2
RANKS = 2


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.lora.conftest import make_adapter

    root = tmp_path_factory.mktemp("dashboard-adapters")
    make_adapter(tiny_llama_dir, root / "runtime", rank=4)
    proc = ServerProcess(
        *producer_server_args(tiny_llama_dir, "--tensor-parallel-size", str(RANKS)),
        "--worker-notification-buffer-size", str(BUFFER),
        "--api-key", KEY,
        "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "2", "--max-lora-rank", "8",
        "--allowed-lora-paths", str(root),
        "--allow-runtime-lora-updating",
        api_server_count=SERVERS,
    )  # fmt: skip
    proc.adapter = root / "runtime"  # type: ignore[attr-defined]
    with proc.running():
        yield proc


@pytest.fixture(scope="module")
def pages(server: Any) -> Iterator[dict[str, WebDriver]]:
    """One browser per API server, keyed by the server its page's event stream comes from.

    Each page is its own Chromium: tabs of one browser share its connection pool, and a reused
    connection would keep landing on the same server. The first page also checks the key gate:
    nothing is shown until the key is given."""
    found = find_chromium()
    if isinstance(found, str):
        pytest.skip(f"no headless Chromium here: {found}")
    pages: dict[str, WebDriver] = {}
    deadline = time.monotonic() + 120
    with ExitStack() as kept:
        while len(pages) < SERVERS:
            assert time.monotonic() < deadline, f"event streams only from servers {sorted(pages)}"
            with ExitStack() as attempt:
                browser = attempt.enter_context(chromium())
                stream = _open_with_key(browser, server.url, check_gate=not pages)
                if stream not in pages:
                    pages[stream] = browser
                    kept.enter_context(attempt.pop_all())
        yield pages


def _open_with_key(browser: WebDriver, url: str, check_gate: bool) -> str:
    """Open the page, give it the key; the API server its event stream comes from."""
    from selenium.webdriver.common.by import By

    browser.get(f"{url}/dashboard")
    wait_for(lambda: browser.find_element(By.ID, "key-form").is_displayed(), 10, "key form")
    if check_gate:
        assert browser.find_element(By.ID, "status").text == "needs the API key"
        assert browser.find_elements(By.CSS_SELECTOR, "#engines tbody tr") == []
        assert browser.find_elements(By.CSS_SELECTOR, "#events li") == []
    browser.find_element(By.ID, "api-key").send_keys(KEY)
    browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
    stream = wait_for_stream(browser, 20)
    wait_for(lambda: _engine_cell(browser, 0, "state") == "up", 20, "engine 0 shown up")
    return stream


def _engine_cell(browser: WebDriver, engine: int, name: str) -> str | None:
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By

    try:
        selector = f'#engines tr[data-engine="{engine}"] td.{name}'
        return browser.find_element(By.CSS_SELECTOR, selector).text
    except (NoSuchElementException, StaleElementReferenceException):
        return None


# Installed by the test in each page before the load: the page's clock when the grid first
# shows the adapter in a device slot on both ranks (whatever made it: an event or a poll).
WATCH_GRID = """
window.gridShown = null;
const grid = document.querySelector("#lora-grid tbody");
new MutationObserver(() => {
  const row = grid.querySelector('tr[data-adapter="runtime"]');
  if (window.gridShown || !row) return;
  const tiers = [...row.querySelectorAll("td.cell")].map(
    (c) => `${c.dataset.engine}:${c.dataset.rank}=${c.dataset.tier}`);
  if (tiers.join(" ") === "0:0=device 0:1=device") window.gridShown = Date.now() / 1000;
}).observe(grid, {childList: true, subtree: true, attributes: true});
"""


def _lora_event_times(browser: WebDriver, adapter: str, count: int) -> list[float] | None:
    """When the ranks made the adapter's lifecycle events the page listed (epoch seconds),
    once it lists `count` of them."""
    from selenium.webdriver.common.by import By

    items = browser.find_elements(By.CSS_SELECTOR, '#events li[data-type^="lora_adapter_"]')
    times = [float(li.get_attribute("data-ts") or 0) for li in items if adapter in li.text]
    return times if len(times) == count else None


def test_an_adapter_loaded_shows_on_the_page_of_both_servers_within_a_second(
    server: Any, pages: dict[str, WebDriver]
) -> None:
    for browser in pages.values():
        browser.execute_script(WATCH_GRID)
    response = httpx.post(
        f"{server.url}/v1/load_lora_adapter",
        json={"lora_name": "runtime", "lora_path": str(server.adapter)},
        headers=AUTH,
        timeout=60,
    )
    assert response.status_code == 200, response.text
    for stream, browser in pages.items():
        shown = wait_for(
            lambda browser=browser: browser.execute_script("return window.gridShown"),
            5,
            f"the adapter on both ranks (events from server {stream})",
        )
        # loaded and activated on each of the two ranks; the grid is complete at the last.
        times = wait_for(
            lambda browser=browser: _lora_event_times(browser, "runtime", 4),
            5,
            f"the four lifecycle events in the list ({stream})",
        )
        delay = float(shown) - max(times)
        assert 0 <= delay < 1.0, f"server {stream}'s page showed the load {delay:.3f} s late"


def test_an_event_burst_that_overflows_shows_its_drop_marker(
    server: Any, pages: dict[str, WebDriver]
) -> None:
    from selenium.webdriver.common.by import By

    response = httpx.post(
        f"{server.url}/collective_rpc",
        json={"method": "publish_events", "args": [BUFFER + 9, "test.flood", [1]]},
        headers=AUTH,
        timeout=60,
    )
    assert response.status_code == 200, response.text
    marker = "9 event(s) dropped at engine 0 rank 1 before this point"
    for stream, browser in pages.items():

        def gaps(browser: WebDriver = browser) -> list[str]:
            return [li.text for li in browser.find_elements(By.CSS_SELECTOR, "#events li.gap")]

        wait_for(lambda: any(marker in g for g in gaps()), 10, f"the drop marker ({stream})")
        floods = browser.find_elements(By.CSS_SELECTOR, '#events li[data-type="custom"]')
        assert sum("test.flood" in li.text for li in floods) == BUFFER, "the events kept"


def _publish(server: Any, count: int, key: str) -> None:
    """`count` custom events with `key` from every rank (through whichever server answers)."""
    response = httpx.post(
        f"{server.url}/collective_rpc",
        json={"method": "publish_events", "args": [count, key]},
        headers=AUTH,
        timeout=60,
    )
    assert response.status_code == 200, response.text


def _listed(browser: WebDriver, key: str) -> list[str]:
    """The ids of the listed events with `key`, newest first."""
    from selenium.webdriver.common.by import By

    items = browser.find_elements(By.CSS_SELECTOR, "#events li.event")
    return [li.find_element(By.CLASS_NAME, "id").text for li in items if key in li.text]


def _streams_opened(browser: WebDriver) -> int:
    from selenium.webdriver.common.by import By

    state = browser.find_element(By.ID, "events-state")
    return int(state.get_attribute("data-opened") or 0)


def _filter(browser: WebDriver, types: str, keys: str) -> None:
    """Set the page's filter and wait for its stream to reopen with it."""
    from selenium.webdriver.common.by import By

    opened = _streams_opened(browser)
    for field, value in (("filter-type", types), ("filter-key", keys)):
        box = browser.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    browser.find_element(By.CSS_SELECTOR, "#event-filter button").click()
    wait_for(lambda: _streams_opened(browser) > opened, 10, "the stream to reopen")


def test_a_filter_shows_only_the_events_asked_for(server: Any, pages: dict[str, WebDriver]) -> None:
    from selenium.webdriver.common.by import By

    browser = next(iter(pages.values()))
    _filter(browser, "custom", "test.wanted")
    assert browser.find_elements(By.CSS_SELECTOR, "#events li") == [], "the list starts over"
    _publish(server, 2, "test.other")
    _publish(server, 2, "test.wanted")
    wait_for(lambda: len(_listed(browser, "test.wanted")) == 4, 10, "the wanted events")
    items = browser.find_elements(By.CSS_SELECTOR, "#events li")
    assert len(items) == 4 and not _listed(browser, "test.other"), [li.text for li in items]
    _filter(browser, "", "")


def test_a_page_whose_server_died_resumes_where_it_stopped(
    server: Any, pages: dict[str, WebDriver]
) -> None:
    """The API server feeding a page is killed while events are published. The page reconnects
    with `Last-Event-ID`: from the sibling, whose ring holds them, it gets each missed event
    once and no gap; from the killed server's replacement, if that is up first, whose ring
    began after them, a replay-gap marker says they are lost to this page (either way, nothing
    twice and nothing missing unsaid)."""
    from selenium.webdriver.common.by import By

    browser = next(iter(pages.values()))
    _publish(server, 1, "test.before")

    # One event from each rank; they may reach the page in different broadcasts, and the page
    # resumes after the later one.
    def before_from_each_rank() -> list[str] | None:
        ids = _listed(browser, "test.before")
        return ids if len(ids) == RANKS else None

    before = wait_for(before_from_each_rank, 10, "the events before, one from each rank")
    last = max(before, key=lambda id: tuple(int(part) for part in id.split(":")))
    # The server its stream comes from now (a reconnect, e.g. the filter's, may have moved it).
    state = browser.find_element(By.ID, "events-state")
    killed = state.get_attribute("data-server")
    role = f"api_server_{killed}"
    old = server.pid_of(role)
    os.kill(old, signal.SIGKILL)
    # Until its listening socket is closed (a few ms after the process ends) it still takes a
    # share of new connections, which the kernel then resets: publish once only the sibling's
    # listens.
    port = int(server.url.rsplit(":", 1)[1])
    wait_for(lambda: sockets_on_port(port, TCP_LISTEN) == 1, 10, "the killed server's socket")
    _publish(server, 3, "test.resume")  # while the page reconnects (it waits a second)
    wait_for(
        lambda: state.get_attribute("data-resumed-after") == last,
        20,
        f"the page to resume after {last}",
    )

    def gaps() -> list[str]:
        items = browser.find_elements(By.CSS_SELECTOR, '#events li[data-type="replay_gap"]')
        return [li.text for li in items]

    if state.get_attribute("data-server") != killed:
        wait_for(lambda: len(_listed(browser, "test.resume")) >= 3 * RANKS, 10, "the missed events")
        assert gaps() == [], "a resume the sibling's ring could serve shows no gap"
    else:
        wait_for(gaps, 10, "the replay-gap marker of a ring that began after the events")
    ids = _listed(browser, "test.resume")
    assert len(ids) == len(set(ids)), f"an event shown twice: {ids}"
    wait_for(lambda: _pid(server, role) not in (None, old), 60, f"{role} restarted")
    server.wait_healthy()


def _pid(server: Any, role: str) -> int | None:
    try:
        return int(server.pid_of(role))
    except LookupError:
        return None


def test_a_killed_engine_core_shows_down_then_back_under_the_next_incarnation(
    server: Any, pages: dict[str, WebDriver]
) -> None:
    # Every state the engine row shows, recorded by the page itself: a restart may be quicker
    # than this test's look at the page.
    for stream, browser in pages.items():
        # Read until the row holds still: the page re-renders it at every /health poll, and a
        # read between the find and the text meets the replaced element.
        wait_for(
            lambda browser=browser: _engine_cell(browser, 0, "incarnation") == "0",
            10,
            f"engine 0 under incarnation 0 ({stream})",
        )
        browser.execute_script(
            """
            window.seenStates = [];
            const table = document.querySelector("#engines tbody");
            new MutationObserver(() => {
              const cell = table.querySelector('tr[data-engine="0"] td.state');
              if (cell) window.seenStates.push(cell.textContent);
            }).observe(table, {childList: true, subtree: true, characterData: true});
            """
        )
    os.kill(server.pid_of("engine_core_dp0"), signal.SIGKILL)
    for stream, browser in pages.items():
        wait_for(
            lambda browser=browser: (
                _engine_cell(browser, 0, "state") == "up"
                and _engine_cell(browser, 0, "incarnation") == "1"
            ),
            90,
            f"engine 0 back under incarnation 1 ({stream})",
        )
        seen = browser.execute_script("return window.seenStates")
        assert any(not state.startswith("up") for state in seen), f"never shown down: {seen}"


def _offline(browser: WebDriver, offline: bool) -> None:
    """Cut the page off the network, or let it back (Chromium's own emulation: new requests
    fail at once, as when a laptop drops off the Wi-Fi)."""
    browser.execute_cdp_cmd("Network.enable", {})
    browser.execute_cdp_cmd(
        "Network.emulateNetworkConditions",
        {"offline": offline, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1},
    )


def _engine_0_up_under(server: Any, incarnation: int) -> bool:
    """Whether every API server's /health has engine 0 up under `incarnation`."""
    seen: dict[str, bool] = {}
    deadline = time.monotonic() + 30
    while len(seen) < SERVERS:
        assert time.monotonic() < deadline, f"/health answered only by servers {sorted(seen)}"
        response = httpx.get(f"{server.url}/health", headers=AUTH, timeout=10)
        engines = response.json().get("engines", [])
        seen[response.headers["x-rankcast-api-server"]] = any(
            e["engine"] == 0 and e["up"] and e["incarnation"] == incarnation for e in engines
        )
    return all(seen.values())


def test_a_page_cut_off_across_an_engine_restart_shows_what_it_missed_as_a_gap(
    server: Any, pages: dict[str, WebDriver]
) -> None:
    """A page whose stream was cut while the engine core restarted resumes from an id of the
    dead incarnation. What that incarnation had not sent is lost, and no server can replay it:
    the page must show the hole as one, a marked band whose id column names the range between
    the last event the page had and the first one replayed, standing between those two lines,
    not as one more event among them."""
    from selenium.webdriver.common.by import By

    browser = next(iter(pages.values()))
    _publish(server, 1, "test.before-cut")
    wait_for(lambda: _listed(browser, "test.before-cut"), 10, "the events before the cut")
    state = browser.find_element(By.ID, "events-state")
    # Off the network, the page keeps the stream it has; killing the API server that feeds it
    # ends that one, and the page can open no other until it is back on the network.
    feeding = f"api_server_{state.get_attribute('data-server')}"
    _offline(browser, True)
    try:
        os.kill(server.pid_of(feeding), signal.SIGKILL)
        wait_for(lambda: state.text.startswith("reconnecting"), 10, "the page to lose its stream")
        had = browser.find_elements(By.CSS_SELECTOR, "#events li")[0]
        last = had.find_element(By.CLASS_NAME, "id").text
        incarnation = int(last.split(":")[1])
        os.kill(server.pid_of("engine_core_dp0"), signal.SIGKILL)
        wait_for(
            lambda: _engine_0_up_under(server, incarnation + 1), 90, "the engine's next incarnation"
        )
        _publish(server, 1, "test.after-cut")
    finally:
        _offline(browser, False)
    wait_for(lambda: _listed(browser, "test.after-cut"), 30, "the events after the restart")

    # The list is newest first: the line right above the last event the page had is the band,
    # and the one above it the first event replayed.
    items = browser.find_elements(By.CSS_SELECTOR, "#events li")
    at = items.index(had) - 1
    gap = items[at]
    replayed = items[at - 1].find_element(By.CLASS_NAME, "id").text
    assert gap.is_displayed()
    assert gap.find_element(By.CLASS_NAME, "id").text == f"{last} \u2026 {replayed}", gap.text
    assert f"events missing after {last}, before {replayed}" in gap.text
    assert f"incarnation {incarnation} -> {incarnation + 1}" in gap.text
    # Distinct from the event lines around it, as the eye sees them: another background.
    look = "const s = getComputedStyle(arguments[0]); return s.backgroundImage + s.backgroundColor;"
    band = browser.execute_script(look, gap)
    assert band not in {browser.execute_script(look, li) for li in (items[at - 1], had)}, band
