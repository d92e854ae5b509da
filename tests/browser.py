"""Headless Debian chromium driven by Selenium, for the monitor's page (``make browser`` installs chromium as
root). The flags keep chromium off the network beyond the page (this machine's network is closed: without them
it retries Google's hosts at every start)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--window-size=1100,1000"]


def browser_missing() -> str:
    """Why no browser test can run here ("" when it can)."""
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        return f"no {CHROMIUM} and {CHROMEDRIVER} (make browser, as root, installs Debian's chromium)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (make install)"
    return ""


@contextlib.contextmanager
def headless_chromium(timeout: float = 30.0) -> Iterator:
    """A Selenium driver of a fresh headless chromium (its own profile dir), quit at the end."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="swarmloco-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in [*FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=str(CHROMEDRIVER)))
    driver.set_page_load_timeout(timeout)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def table_rows(driver, selector: str) -> list[list[str]]:
    """The text of every cell of the rows ``selector`` finds, read in one script (a page that re-renders between
    two WebDriver calls would leave stale elements)."""
    return driver.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0]), r => Array.from(r.cells, c => c.textContent));",
        selector)
