"""A real headless Chromium for the dashboard's tests and screenshots (Debian's `chromium`
and `chromium-driver`, which `make test` installs where it can), driven through Selenium."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

T = TypeVar("T")


def find_chromium() -> tuple[str, str] | str:
    """(browser, driver) executables, or why there are none."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver") or "/usr/bin/chromedriver"
    if browser is None:
        return "no chromium on PATH (Debian: apt-get install chromium chromium-driver)"
    if not shutil.which(driver):
        return "no chromedriver (Debian: apt-get install chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    return browser, driver


@contextmanager
def chromium(width: int = 1500, height: int = 1100) -> Iterator[WebDriver]:
    """A headless Chromium, always quit (with its renderer processes) on leaving."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    found = find_chromium()
    assert not isinstance(found, str), found
    browser, driver_path = found
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in (
        "--headless=new",
        "--no-sandbox",  # root in CI containers
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={width},{height}",
        # Background tabs keep their timers and streams at full rate (several pages are open
        # at once, and only one is in front).
        "--disable-background-timer-throttling",
        "--disable-renderer-backgrounding",
        "--disable-backgrounding-occluded-windows",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for_stream(browser: WebDriver, timeout: float = 30) -> str:
    """Wait for the open page's event stream; the API server it comes from."""
    from selenium.webdriver.common.by import By

    server: str = wait_for(
        lambda: browser.find_element(By.ID, "events-state").get_attribute("data-server"),
        timeout,
        "the page's event stream",
    )
    return server


def wait_for(condition: Callable[[], T | None], timeout: float, what: str) -> T:
    """Poll `condition` until it returns something truthy; fail naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)
