"""The attempt's log page in the admin (logs_app/admin.py): its lines, its error beside
them, breadcrumbs to its run and job, and the live tail's wiring while it runs (the tail
itself runs in a browser: tests/browser/test_admin_browser.py)."""

from __future__ import annotations

import pytest
from django.urls import reverse

from jobs.outcomes import attempt_record_failure
from tests.factories import PINNED_NOW, running_attempt, superuser
from tests.logs.test_api import ship

pytestmark = pytest.mark.django_db


def log_page(client, attempt) -> str:
    client.force_login(superuser("op"))
    page = client.get(reverse("admin:logs_app_attempt_log", args=[attempt.id]))
    assert page.status_code == 200
    return page.content.decode()


def test_a_running_attempts_page_follows_its_log_through_the_api(client, queued_run):
    attempt = running_attempt(queued_run)
    ship(attempt, 0, 0, 3, text="so far")
    page = log_page(client, attempt)
    assert "so far 2" in page
    assert 'data-follow="true"' in page and 'data-after="2"' in page
    assert f'data-logs-url="/api/v1/runs/{attempt.run_id}/logs/?attempt=1"' in page
    assert '/static/logs_app/live_tail.js"' in page
    assert f'href="/admin/jobs/run/{attempt.run_id}/change/" id="crumb-run"' in page
    assert f'href="/admin/jobs/job/{attempt.run.job_id}/change/" id="crumb-job"' in page
    assert "None yet: the attempt is running." in page


def test_a_failed_attempts_traceback_is_beside_its_log(client, queued_run):
    attempt = running_attempt(queued_run, retry={"max_attempts": 1})
    ship(attempt, 0, 0, 2, text="before the crash")
    attempt_record_failure(attempt=attempt, spec=attempt.run.job_version.spec, retry_base=0,
                           ended="failed", error="Traceback (most recent call last):\n"
                           "ValueError: no such customer", now=PINNED_NOW, by="worker")  # fmt: skip
    page = log_page(client, attempt)
    assert 'data-follow="false"' in page
    assert "before the crash 1" in page
    assert '<pre id="log-error" class="log-error">Traceback (most recent call last):\n' \
           "ValueError: no such customer</pre>" in page  # fmt: skip
