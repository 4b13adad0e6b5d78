"""Headless Chromium through selenium, as the page tests and bench/scale.py drive it."""

from __future__ import annotations

import shutil
from contextlib import contextmanager
from typing import Callable, Iterator

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1500,1000")


@contextmanager
def chromium() -> Iterator["object"]:
    """A selenium driver on Debian's chromium and chromedriver; quit however the test ends."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"))
    try:
        yield driver
    finally:
        driver.quit()


def quietly(predicate: Callable[[], object]) -> Callable[[], object]:
    """A wait_for predicate that is simply false while the page is still rendering."""
    def check():
        try:
            return predicate()
        except Exception:  # selenium raises while an element is missing or being replaced
            return False
    return check
