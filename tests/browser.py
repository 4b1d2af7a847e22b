"""Debian's headless Chromium, driven by Selenium through Debian's chromedriver: the browser
tests/test_map.py and `bench.map` show the live map in (scripts/test.sh installs both
packages; a test tool's own browser download cannot be fetched here)."""

from __future__ import annotations

import base64

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


def chromium(width: int = 1400, height: int = 900) -> webdriver.Chrome:
    """Debian's headless Chromium, with nothing that reaches outside this machine."""
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage", f"--window-size={width},{height}",
    ):  # fmt: skip
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))


def sign_in(driver: webdriver.Chrome, user: str, password: str) -> None:
    """Send the operator's basic auth with every request the page makes (its event stream
    too), as a browser does once a person typed them in."""
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd(
        "Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Basic {token}"}}
    )
