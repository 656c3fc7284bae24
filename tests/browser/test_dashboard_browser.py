"""The dashboard in a real browser: its plots drawn from the runs a real stack ran, its
figures those of the database, and its panel refreshed in place (no reload) as more runs
finish. Screenshots kept (tests/browser/conftest.py)."""

from __future__ import annotations

import pytest

from jobs.models import Run, RunState
from tests.dispatch.test_dashboard import series_max
from tests.factories import one_time_job
from tests.processes import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.browser]


def _succeeded() -> int:
    return Run.objects.filter(state=RunState.SUCCEEDED).count()


def _run_jobs(count: int, already: int) -> None:
    for index in range(count):
        one_time_job(task="tests.record", args=[index])
    wait_for(lambda: _succeeded() >= already + count, timeout=90,
             message=f"{count} runs to succeed")  # fmt: skip


def test_the_dashboard_draws_real_figures_and_refreshes_in_place(browser, stack):
    stack.scheduler()
    stack.relay()
    stack.worker()
    _run_jobs(5, already=0)

    browser.get("/dashboard/")
    figure = browser.wait_for_css('[data-figure="runs-succeeded"]')
    assert figure.text == str(_succeeded()) == "5"
    # Every lag plot has its series drawn, and the discovery lag's p99 is one of the runs'.
    charts = browser.find_all("svg.chart")
    assert len(charts) >= 4
    drawn = browser.find_all("svg.chart [data-series]")
    assert drawn, "no series drawn"
    peaks = [float(item.get_attribute("data-max")) for item in drawn]
    assert any(peak > 0 for peak in peaks), peaks
    # The run-duration plot's p99 peak is the longest run's duration (p99 of under 100
    # values is their maximum), drawn as the server measured it.
    durations = [
        (run.finished_at - run.started_at).total_seconds()
        for run in Run.objects.filter(state=RunState.SUCCEEDED)
    ]
    peaks = series_max(browser.driver.page_source, "run duration")
    assert peaks["p99"] == pytest.approx(max(durations), rel=1e-3, abs=1e-3), (peaks, durations)
    browser.screenshot("dashboard")

    # The panel refreshes itself: a marker set on the page survives while the count moves.
    browser.driver.execute_script("window.__not_reloaded = true;")
    _run_jobs(3, already=5)
    browser.wait_for(
        lambda driver: (
            driver.find_element("css selector", '[data-figure="runs-succeeded"]').text == "8"
        ),
        timeout=30,
        message="the panel to show 8 succeeded runs",
    )
    assert browser.driver.execute_script("return window.__not_reloaded === true;")
    browser.screenshot("dashboard-refreshed")
