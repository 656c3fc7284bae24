"""An operator in a real browser: logging in, pausing a job from the admin, replaying a
failed run on a real worker, and watching an attempt's log grow while it runs. Each test
keeps screenshots (tests/browser/conftest.py)."""

from __future__ import annotations

import json

import pytest
import requests
from selenium.webdriver.support.ui import Select

from jobs.models import Attempt, AttemptState, Run, RunState
from tests.browser.conftest import PASSWORD
from tests.factories import make_job, one_time_job, superuser, token_for
from tests.processes import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.browser]

HOURLY = {"kind": "cron", "expression": "0 * * * *", "timezone": "Europe/Berlin"}


def api_get(browser, path: str) -> dict:
    """The API's answer to the operator's token (not the browser's session)."""
    response = requests.get(
        browser.base_url + path,
        headers={"Authorization": f"Token {token_for(browser.user)}"},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_an_operator_logs_in(chromium, transactional_db):
    superuser("night-shift", PASSWORD)
    chromium.log_in("night-shift", "wrong")
    note = chromium.wait_for_css(".errornote")
    assert "correct username and password" in note.text
    chromium.screenshot("refused")
    chromium.log_in("night-shift", PASSWORD)
    tools = chromium.wait_for_css("#user-tools")
    assert "NIGHT-SHIFT" in tools.text.upper()
    chromium.screenshot("logged-in")


def test_pausing_a_job_from_the_admin_is_seen_through_the_api(browser):
    job = make_job(browser.user, name="hourly report", schedule=HOURLY)
    other = make_job(browser.user, name="left alone", schedule=HOURLY)
    browser.get("/admin/jobs/job/")
    row = browser.find(f"input[name=_selected_action][value='{job.pk}']")
    row.click()
    Select(browser.find("select[name=action]")).select_by_value("pause_jobs")
    browser.find("button[name=index]").click()
    browser.wait_for(lambda d: browser.messages(), message="no message after the action")
    assert browser.messages() == ["Paused 1 of 1 selected jobs."]
    browser.screenshot("list-after-pause")
    assert api_get(browser, f"/api/v1/jobs/{job.id}/")["state"] == "paused"
    assert api_get(browser, f"/api/v1/jobs/{other.id}/")["state"] == "active"

    # The job's page: its schedule in words, and its buttons (resume, from the page).
    browser.get(f"/admin/jobs/job/{job.id}/change/")
    assert "Every hour (Europe/Berlin time" in browser.find("#job-schedule").text
    assert len(browser.find_all("#next-fires tbody tr")) == 10
    browser.screenshot("job-page")
    browser.find("#do-resume_jobs").click()
    browser.wait_for(lambda d: browser.messages(), message="no message after resume")
    assert browser.messages() == ["Resumed 1 of 1 selected jobs."]
    assert browser.driver.current_url.endswith(f"/admin/jobs/job/{job.id}/change/")
    assert api_get(browser, f"/api/v1/jobs/{job.id}/")["state"] == "active"


def set_body(browser, body: dict) -> None:
    area = browser.find("textarea[name=body]")
    browser.driver.execute_script("arguments[0].value = arguments[1];", area, json.dumps(body))
    browser.find("input[name=_save]").click()


def test_creating_and_editing_a_job_from_the_admin(browser):
    browser.get("/admin/jobs/job/add/")
    assert "scheduler.echo" in browser.find("textarea[name=body]").get_attribute("value")
    body = {"name": "from the browser", "task": "tests.record",
            "schedule": {"kind": "cron", "expression": "0 9 * * MON-FRI",
                         "timezone": "Mars/Olympus"}}  # fmt: skip
    set_body(browser, body)
    errors = browser.wait_for_css(".errorlist").text
    assert "schedule.timezone:" in errors
    browser.screenshot("refused-body")
    body["schedule"]["timezone"] = "Europe/Berlin"
    set_body(browser, body)
    browser.wait_for(lambda d: browser.messages(), message="no message after saving")
    [job] = api_get(browser, "/api/v1/jobs/")["results"]
    assert (job["name"], job["version"], job["owner"]) == ("from the browser", 1, "operator")

    browser.get(f"/admin/jobs/job/{job['id']}/change/")
    set_body(browser, {"schedule": {**body["schedule"], "expression": "30 10 * * MON-FRI"}})
    browser.wait_for(lambda d: browser.messages(), message="no message after the edit")
    assert api_get(browser, f"/api/v1/jobs/{job['id']}/")["version"] == 2
    browser.get(f"/admin/jobs/job/{job['id']}/change/")
    diff = browser.find("#job-versions").text
    assert 'schedule.expression: "0 9 * * MON-FRI" → "30 10 * * MON-FRI"' in diff
    assert "At 10:30, Monday through Friday" in browser.find("#job-schedule").text
    browser.driver.execute_script("document.getElementById('job-history').scrollIntoView();")
    browser.screenshot("history")


def test_replaying_a_failed_run_from_its_page_makes_it_succeed(browser, stack):
    stack.scheduler()
    stack.relay()
    stack.worker()
    job = one_time_job(task="faults.fail_first", retry={"max_attempts": 1})
    run = wait_for(
        lambda: Run.objects.filter(job=job, state=RunState.FAILED).first(),
        timeout=60,
        message="the run to fail",
    )
    browser.get(f"/admin/jobs/run/{run.id}/change/")
    assert "RuntimeError: first attempt fails" in browser.find("#attempt-1 .attempt-error").text
    assert "failed" in browser.find("#run-summary h2").text
    browser.screenshot("failed-run")

    browser.find("#do-replay_runs").click()
    browser.wait_for(lambda d: browser.messages(), message="no message after the replay")
    assert browser.messages() == ["Replayed 1 of 1 selected runs."]
    wait_for(
        lambda: Run.objects.filter(id=run.id, state=RunState.SUCCEEDED).exists(),
        timeout=60,
        message="the replayed run to succeed",
    )
    browser.get(f"/admin/jobs/run/{run.id}/change/")
    assert "succeeded" in browser.find("#run-summary h2").text
    assert "succeeded" in browser.find("#attempt-2").text
    stages = browser.find("#run-timeline").text
    assert "run duration" in stages and "not yet" not in stages
    browser.screenshot("replayed-run")
    answer = api_get(browser, f"/api/v1/runs/{run.id}/")
    assert answer["state"] == "succeeded" and len(answer["attempts"]) == 2


def test_an_attempts_log_grows_in_the_browser_while_it_runs(browser, stack):
    stack.scheduler()
    stack.relay()
    stack.worker()
    # 30 lines over 15 s; the worker ships them as they come (every second).
    job = one_time_job(task="faults.chatty", args=[30, 15.0])
    attempt = wait_for(
        lambda: Attempt.objects.filter(run__job=job).first(),
        timeout=60,
        message="the attempt to start",
    )
    browser.get(f"/admin/logs_app/logmanifest/attempt/{attempt.id}/")
    assert browser.find("#log-view").get_attribute("data-follow") == "true"

    def shown() -> int:
        return browser.find("#log-lines").text.count("attempt 1 line")

    counts = [shown()]
    # Grows at least twice while the page stays loaded (no reload).
    for _ in range(2):
        counts.append(
            browser.wait_for(lambda d, last=counts[-1]: shown() > last and shown(), timeout=15)
        )
    browser.screenshot("growing")
    assert Attempt.objects.get(id=attempt.id).state == AttemptState.RUNNING, counts
    browser.wait_for(lambda d: "Complete" in browser.find("#log-status").text, timeout=60)
    assert shown() == 30 and counts[0] < counts[1] < counts[2] < 30
    assert browser.find("#attempt-state").text == "succeeded"
    # Then the run's API gives the attempt's final word: no error.
    browser.wait_for(lambda d: browser.find("#log-no-error").text == "None.", timeout=10)
    # The breadcrumbs lead back to the run and the job.
    assert (
        browser.find("#crumb-run")
        .get_attribute("href")
        .endswith(f"/admin/jobs/run/{attempt.run_id}/change/")
    )
    assert (
        browser.find("#crumb-job")
        .get_attribute("href")
        .endswith(f"/admin/jobs/job/{job.id}/change/")
    )
    browser.screenshot("complete")
