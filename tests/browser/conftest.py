"""Headless Chromium against the live test server, for tests of what an operator sees.

Debian's `chromium` and `chromium-driver` through Selenium (no browser is downloaded; the
network is closed). Fixtures:
- `chromium`: a `Browser` on a fresh profile, not logged in;
- `browser`: the same, logged in to the admin as a superuser (`browser.user`);
- `browser.screenshot(name)` saves a PNG under tests/artifacts/ (or the directory in
  SCHEDULER_TEST_ARTIFACTS), named after the test, and returns its path.
Without Chromium the tests fail, saying what to install: they are never skipped.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("SCHEDULER_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("SCHEDULER_CHROMEDRIVER", "/usr/bin/chromedriver")
ARTIFACTS = Path(
    os.environ.get("SCHEDULER_TEST_ARTIFACTS", Path(__file__).resolve().parent.parent / "artifacts")
)
PASSWORD = "operator-pw"
WAIT_SECONDS = 20
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,1100",
]


def _require_chromium() -> None:
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not shutil.which(path)]
    if missing:
        pytest.fail(
            f"the browser tests need headless Chromium and its driver; not found: "
            f"{', '.join(missing)}. Install Debian's packages: "
            "`apt-get install -y chromium chromium-driver` (or point SCHEDULER_CHROMIUM and "
            "SCHEDULER_CHROMEDRIVER at them)",
            pytrace=False,
        )


class Browser:
    """A Selenium driver with the live server's address, waits, and screenshots."""

    def __init__(self, driver, base_url: str, test_name: str) -> None:
        self.driver = driver
        self.base_url = base_url
        self.test_name = re.sub(r"[^A-Za-z0-9_.-]+", "_", test_name)
        self.user = None

    def get(self, path: str) -> None:
        self.driver.get(self.base_url + path)

    def find(self, css: str):
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.CSS_SELECTOR, css)

    def find_all(self, css: str) -> list:
        from selenium.webdriver.common.by import By

        return self.driver.find_elements(By.CSS_SELECTOR, css)

    def wait_for(self, condition, timeout: float = WAIT_SECONDS, message: str = ""):
        """Wait until `condition(driver)` is true (a Selenium expected condition, or any
        callable of the driver). An element replaced between its lookup and its reading
        (a page that refreshes in place) is looked up again at the next poll."""
        from selenium.common.exceptions import StaleElementReferenceException
        from selenium.webdriver.support.ui import WebDriverWait

        return WebDriverWait(
            self.driver,
            timeout,
            poll_frequency=0.2,
            ignored_exceptions=(StaleElementReferenceException,),
        ).until(condition, message)

    def wait_for_css(self, css: str, timeout: float = WAIT_SECONDS):
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support import expected_conditions as ec

        return self.wait_for(
            ec.presence_of_element_located((By.CSS_SELECTOR, css)), timeout, f"no {css}"
        )

    def messages(self) -> list[str]:
        """The admin's messages on the page (success, warning, error)."""
        return [item.text for item in self.find_all("ul.messagelist li")]

    def log_in(self, username: str, password: str) -> None:
        self.get("/admin/login/?next=/admin/")
        self.find("#id_username").send_keys(username)
        self.find("#id_password").send_keys(password)
        self.find("#login-form [type=submit]").click()

    def screenshot(self, name: str) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"{self.test_name}-{name}.png"
        self.driver.save_screenshot(str(path))
        return path


@pytest.fixture
def chromium(live_server, request):
    """Headless Chromium on a fresh profile, against the live server; not logged in."""
    _require_chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="scheduler-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield Browser(driver, live_server.url, request.node.name)
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def browser(chromium):
    """`chromium`, logged in to the admin as the superuser `operator`."""
    from tests.factories import superuser

    chromium.user = superuser("operator", PASSWORD)
    chromium.log_in("operator", PASSWORD)
    chromium.wait_for_css("#user-tools")
    return chromium
