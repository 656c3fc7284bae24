"""What a newcomer meets in a real browser: the landing page (signed out and in), the API
docs page sending a signed-out visitor to sign in and back, the admin's lists newest first
with short ids and the last outcome, the buttons of a job and a run in each of their
states, and the dashboard in the product's frame with a logout. Screenshots kept
(tests/browser/conftest.py)."""

from __future__ import annotations

import datetime as dt

import pytest

from jobs.models import Job, JobState, Run, RunState
from tests.browser.conftest import PASSWORD
from tests.factories import later, make_job, queued_run, superuser

pytestmark = [pytest.mark.slow, pytest.mark.browser]

HOURLY = {"kind": "cron", "expression": "0 * * * *", "timezone": "UTC"}


def _buttons(browser) -> set[str]:
    return {b.get_attribute("id").removeprefix("do-") for b in browser.find_all("button[id^=do-]")}


def _scrolls_sideways(browser) -> bool:
    """The page, or the list's own box, is wider than the window shows."""
    return browser.driver.execute_script(
        "const d = document.documentElement, r = document.querySelector('.results');"
        "return d.scrollWidth > d.clientWidth || r.scrollWidth > r.clientWidth;"
    )


def test_landing_page_and_docs_page_lead_a_newcomer_in(chromium, transactional_db):
    superuser("newcomer", PASSWORD)
    chromium.get("/")
    chromium.wait_for_css("#link-sign-in")
    chromium.screenshot("landing-signed-out")
    chromium.get("/api/docs/")  # signed out: to the login page, and back after it
    chromium.wait_for_css("#login-form")
    assert "next=/api/docs/" in chromium.driver.current_url
    chromium.screenshot("docs-signed-out")
    chromium.find("#id_username").send_keys("newcomer")
    chromium.find("#id_password").send_keys(PASSWORD)
    chromium.find("#login-form [type=submit]").click()
    chromium.wait_for(lambda d: d.current_url.endswith("/api/docs/"), message="not back at docs")
    chromium.wait_for_css(".swagger-ui")
    chromium.screenshot("docs-signed-in")

    chromium.get("/admin/")
    chromium.find("#user-tools a[href='/']").click()  # the admin's "View site"
    links = {a.get_attribute("id") for a in chromium.find_all("#landing a[id]")}
    assert {"link-admin", "link-dashboard", "link-api-docs"} <= links
    assert chromium.find("#signed-in-as").text.lower() == "newcomer"  # shown in capitals
    chromium.screenshot("landing-signed-in")

    chromium.get("/dashboard/")
    chromium.wait_for_css('[data-figure="runs-succeeded"]')
    assert chromium.driver.title == "Dashboard | Durable job scheduler"
    assert chromium.find("#site-name").text == "Durable job scheduler"
    assert "Django administration" not in chromium.find("#header").text
    chromium.screenshot("dashboard-frame")
    chromium.find("#logout").click()
    chromium.wait_for(lambda d: "logout" in d.current_url, message="not logged out")
    chromium.get("/dashboard/")
    chromium.wait_for_css("#login-form")


def test_lists_newest_first_and_buttons_by_state(browser):
    owner = browser.user
    # The runs first: each one's scheduler pass (at 2030) would catch the hourly jobs up.
    runs = {}
    for n, state in enumerate(RunState.values):
        run = queued_run(owner, run_at=later(60 * n), name=f"run job {n}")
        Run.objects.filter(id=run.id).update(state=state)
        runs[state] = run
    jobs = {}
    for n, state in enumerate(JobState.values):
        job = make_job(owner, name=f"job {state}", schedule=HOURLY,
                       now=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=n))  # fmt: skip
        Job.objects.filter(id=job.id).update(state=state)
        jobs[state] = job

    browser.driver.set_window_size(1280, 900)
    browser.get("/admin/jobs/job/")
    names = [cell.text for cell in browser.find_all("#result_list td.field-name")]
    assert names[0].startswith("run job")  # their jobs were made last (dated 2030)
    assert [name for name in names if not name.startswith("run job")] == [
        f"job {state}" for state in reversed(JobState.values)
    ]
    ids = [cell.text for cell in browser.find_all("#result_list th.field-job_id")]
    assert all(len(text) == 8 for text in ids)
    assert not _scrolls_sideways(browser), "the job list needs a horizontal scrollbar at 1280 px"
    browser.screenshot("jobs-1280")
    browser.get("/admin/jobs/run/")
    shown = [cell.text for cell in browser.find_all("#result_list th.field-run_id")]
    mine = Run.objects.filter(id__in=[run.id for run in runs.values()])
    newest_first = mine.order_by("-created_at", "-id").values_list("id", flat=True)
    assert shown[: len(runs)] == [str(run_id)[:8] for run_id in newest_first]  # dated 2030
    assert not _scrolls_sideways(browser), "the run list needs a horizontal scrollbar at 1280 px"
    browser.screenshot("runs-1280")

    live = {"trigger_jobs", "backfill_jobs", "cancel_jobs"}
    expected_jobs = {
        JobState.ACTIVE: live | {"pause_jobs"},
        JobState.PAUSED: live | {"resume_jobs"},
        JobState.CANCELLED: set(),
        JobState.COMPLETED: set(),
    }
    for state, job in jobs.items():
        browser.get(f"/admin/jobs/job/{job.id}/change/")
        browser.wait_for_css("#job-schedule")
        assert _buttons(browser) == expected_jobs[state], state
        browser.screenshot(f"job-{state}")
    active = {"pending", "queued", "running", "retry_wait"}
    for state, run in runs.items():
        browser.get(f"/admin/jobs/run/{run.id}/change/")
        browser.wait_for_css("#content")
        expected = ({"cancel_runs"} if state in active else set()) | (
            {"replay_runs"} if state in ("failed", "cancelled") else set()
        )
        assert _buttons(browser) == expected, state
        if state in ("failed", "running"):
            browser.screenshot(f"run-{state}")
