"""The admin's job and run pages: creating and editing a job through the API's validation
(jobs/admin/forms.py), the schedule in words with its next fires, recent runs and history,
and the run's timeline with its attempts (jobs/admin/pages.py)."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.db import transaction

from jobs.admin.pages import duration, run_stages, schedule_words
from jobs.clock import db_now
from jobs.models import AuditEvent, Job, JobVersion
from jobs.outcomes import attempt_record_failure
from jobs.services import job_cancel
from tests.factories import PINNED_NOW, claim, job_body, later

pytestmark = pytest.mark.django_db

BERLIN_MORNINGS = {"kind": "cron", "expression": "0 9 * * MON-FRI", "timezone": "Europe/Berlin"}


def add(client, body) -> object:
    return client.post("/admin/jobs/job/add/", {"body": json.dumps(body)})


def edit(client, job, body, *, based_on: int | None = None) -> object:
    return client.post(
        f"/admin/jobs/job/{job.id}/change/",
        {"body": json.dumps(body), "based_on": job.version if based_on is None else based_on},
    )


def test_an_operator_creates_a_job_from_the_admin_as_the_api_would(client, admin_superuser, api):
    response = add(client, job_body(name="from the admin", schedule=BERLIN_MORNINGS))
    assert response.status_code == 302, response.content.decode()[:2000]
    job = Job.objects.get(name="from the admin")
    assert (job.owner, job.version, job.state) == (admin_superuser, 1, "active")
    assert job.spec["retry"]["max_attempts"] == 3  # the API's defaults, stored whole
    assert job.next_run_at is not None
    assert AuditEvent.objects.get(job=job, action="job.created").actor_label == "user:op"
    assert JobVersion.objects.filter(job=job).count() == 1
    assert response["Location"] == "/admin/jobs/job/"


def test_a_bad_body_answers_400_naming_each_field_and_writes_nothing(client, admin_superuser):
    body = job_body(task="no.such.task",
                    schedule={"kind": "cron", "expression": "61 * * * *", "timezone": "Mars/Base"},
                    retry={"max_attempts": 0})  # fmt: skip
    response = add(client, body)
    assert response.status_code == 400
    page = response.content.decode()
    assert "task: &#x27;no.such.task&#x27; is not a registered task" in page
    assert "schedule.expression: " in page and "schedule.timezone: " in page
    assert "retry.max_attempts: Ensure this value is greater than or equal to 1." in page
    assert add(client, {**job_body(), "state": "paused"}).status_code == 400
    invalid_json = client.post("/admin/jobs/job/add/", {"body": "{not json"})
    assert invalid_json.status_code == 400 and b"Enter a valid JSON." in invalid_json.content
    assert not Job.objects.exists()


def test_an_edit_is_a_new_version_with_its_diff_in_the_history(client, admin_superuser, make_job):
    job = make_job(name="reports", schedule=BERLIN_MORNINGS)
    page = client.get(f"/admin/jobs/job/{job.id}/change/").content.decode()
    assert "0 9 * * MON-FRI" in page and 'name="based_on"' in page

    later_mornings = {**BERLIN_MORNINGS, "expression": "30 10 * * MON-FRI"}
    response = edit(client, job, {"schedule": later_mornings})
    assert response.status_code == 302
    job.refresh_from_db()
    assert job.version == 2 and job.spec["schedule"]["expression"] == "30 10 * * MON-FRI"
    assert job.spec["name"] == "reports"  # a field left out keeps its value, as PATCH
    assert AuditEvent.objects.get(job=job, action="job.updated").actor_label == "user:op"

    page = client.get(f"/admin/jobs/job/{job.id}/change/").content.decode()
    assert "<code>schedule.expression</code>: <del>&quot;0 9 * * MON-FRI&quot;</del> &rarr; " \
           "<ins>&quot;30 10 * * MON-FRI&quot;</ins>" in page  # fmt: skip
    assert "job.updated" in page and "user:op" in page


def test_an_edit_shows_secrets_masked_and_keeps_them_when_left_as_shown(
    client, admin_superuser, make_job
):
    job = make_job(kwargs={"password": "canary-7f3", "nested": {"api_key": "canary-9c1"}, "n": 1,
                           "db": "postgres://app:canary-4d2@db/x"})  # fmt: skip
    page = client.get(f"/admin/jobs/job/{job.id}/change/").content.decode()
    assert "canary-7f3" not in page and "canary-9c1" not in page and "canary-4d2" not in page
    assert "[REDACTED]" in page

    shown = {"password": "[REDACTED]", "nested": {"api_key": "[REDACTED]"}, "n": 2,
             "db": "postgres://app:[REDACTED]@db/x"}  # fmt: skip
    assert edit(client, job, {"kwargs": shown}).status_code == 302
    job.refresh_from_db()
    assert job.spec["kwargs"] == {"password": "canary-7f3", "nested": {"api_key": "canary-9c1"},
                                  "n": 2, "db": "postgres://app:canary-4d2@db/x"}  # fmt: skip
    # Changing only the name keeps every secret, partly masked strings included.
    assert edit(client, job, {"name": "renamed"}).status_code == 302
    job.refresh_from_db()
    assert job.spec["kwargs"]["db"] == "postgres://app:canary-4d2@db/x"
    page = client.get(f"/admin/jobs/job/{job.id}/change/").content.decode()
    assert "canary-7f3" not in page  # nor in the version diff of the history

    assert edit(client, job, {"kwargs": {**shown, "password": "replaced"}}).status_code == 302
    job.refresh_from_db()
    assert job.spec["kwargs"]["password"] == "replaced"


def test_adding_a_job_past_the_owners_quota_is_refused_on_the_form(
    client, admin_superuser, make_job, settings
):
    settings.SCHEDULER_OWNER_MAX_JOBS = 1
    make_job(owner=admin_superuser)
    response = add(client, job_body(name="one too many"))
    assert response.status_code == 400
    assert b"SCHEDULER_OWNER_MAX_JOBS" in response.content
    assert not Job.objects.filter(name="one too many").exists()


def test_an_edit_of_a_version_that_moved_on_changes_nothing(client, admin_superuser, make_job):
    job = make_job(schedule=BERLIN_MORNINGS)
    response = edit(client, job, {"name": "renamed"}, based_on=job.version - 1 or 7)
    assert response.status_code == 400
    assert b"The job is at version 1 now" in response.content
    job.refresh_from_db()
    assert job.version == 1 and job.name != "renamed"


@pytest.mark.django_db(transaction=True)
def test_an_edit_that_a_concurrent_edit_makes_a_cycle_is_a_form_error(
    client, admin_superuser, make_job
):
    """Two operators make A after B and B after A at the same moment: the second, whose
    form was checked before the first committed, gets its form back with the cycle named
    (400, as the API answers), and nothing of it is written."""
    import threading

    from jobs.api.validation import job_patched_spec
    from jobs.models import JobDependency
    from jobs.services import job_update
    from tests.threads import in_thread, wait_for_lock_waiters

    a = make_job(name="A", schedule=BERLIN_MORNINGS)
    b = make_job(name="B", schedule=BERLIN_MORNINGS)
    holding, release = threading.Event(), threading.Event()

    def first_edit():  # A after B, committed only once the admin's edit is under way
        with transaction.atomic():
            spec = job_patched_spec(spec=a.spec, patch={"schedule": after(b)})
            assert job_update(job=a, spec=spec, expected_version=1, actor=admin_superuser,
                              now=db_now())  # fmt: skip
            holding.set()
            assert release.wait(30)

    answers, errors = [], []
    first = in_thread(first_edit, errors)
    assert holding.wait(30)
    second = in_thread(lambda: answers.append(edit(client, b, {"schedule": after(a)})), errors)
    wait_for_lock_waiters(1)  # the admin's edit waits for the graph's lock
    release.set()
    first.join(30)
    second.join(30)
    assert not errors, errors
    [response] = answers
    assert response.status_code == 400
    assert b"schedule.jobs: Would make a cycle" in response.content
    b.refresh_from_db()
    assert b.version == 1 and b.spec["schedule"] == BERLIN_MORNINGS
    assert not JobDependency.objects.filter(dependent=b).exists()
    assert not JobVersion.objects.filter(job=b, version=2).exists()
    assert JobDependency.objects.filter(dependent=a, upstream=b).exists()


def after(job) -> dict:
    return {"kind": "after", "jobs": [str(job.id)]}


def test_a_cancelled_job_is_shown_not_edited(client, admin_superuser, make_job):
    job = make_job(schedule=BERLIN_MORNINGS)
    job_cancel(job=job, actor=admin_superuser, now=db_now())
    page = client.get(f"/admin/jobs/job/{job.id}/change/")
    assert page.status_code == 200 and b'name="body"' not in page.content
    assert b"0 9 * * MON-FRI" in page.content  # shown read-only
    assert edit(client, job, {"name": "renamed"}).status_code == 403


def test_adding_and_changing_need_the_models_permissions(client, make_job):
    job = make_job(schedule=BERLIN_MORNINGS)
    viewer = get_user_model().objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_job"))
    client.force_login(viewer)
    assert client.get("/admin/jobs/job/add/").status_code == 403
    assert add(client, job_body()).status_code == 403
    page = client.get(f"/admin/jobs/job/{job.id}/change/")
    assert page.status_code == 200 and b'name="body"' not in page.content
    assert edit(client, job, {"name": "renamed"}).status_code == 403


def test_the_job_page_says_its_schedule_in_words_with_next_fires_and_dst_flags(
    client, admin_superuser, make_job
):
    # 02:30 in New York daily from 2030-03-09: on 2030-03-10 spring-forward skips 02:30.
    job = make_job(
        name="nightly",
        schedule={"kind": "cron", "expression": "30 2 * * *", "timezone": "America/New_York"},
        start_at="2030-03-09T00:00:00Z",
    )
    page = client.get(f"/admin/jobs/job/{job.id}/change/").content.decode()
    assert "At 02:30 (America/New_York time; cron &#x27;30 2 * * *&#x27;), from 2030-03-09" in page
    assert "a local time that spring-forward skips fires once, at the first instant" in page
    assert "2030-03-09 07:30:00" in page  # 02:30 EST
    assert "2030-03-10 07:00:00" in page  # 03:00 EDT, the end of the gap
    assert page.count("moved to the end of a spring-forward gap") == 1
    for action in ("pause_jobs", "cancel_jobs", "trigger_jobs", "backfill_jobs"):
        assert f'id="do-{action}"' in page
    assert 'id="do-resume_jobs"' not in page  # an active job: Pause, not Resume


def test_schedule_words_of_each_kind(settings):
    settings.SCHEDULER_DEPENDENCY_WITHIN_SECONDS = 86400
    fan_in = {"kind": "after", "jobs": ["a", "b"]}
    assert schedule_words({"schedule": fan_in}).endswith(
        "; all within 86400 s of the first (the default bound)."
    )
    assert "within 60 s of the first." in schedule_words(
        {"schedule": {**fan_in, "within_seconds": 60}}
    )
    assert schedule_words({"schedule": {"kind": "interval", "every_seconds": 300}}) == (
        "Every 5 minutes, counted from the job's creation."
    )
    assert schedule_words({"schedule": {"kind": "interval", "every_seconds": 3600},
                           "start_at": "2030-01-01T00:00:00+00:00"}) == (
        "Every hour, counted from start_at, from 2030-01-01 00:00:00 UTC."
    )  # fmt: skip
    assert schedule_words({"schedule": {"kind": "once", "run_at": "2030-01-01T09:00:00+00:00"}}) \
        == "Once, at 2030-01-01 09:00:00 UTC."  # fmt: skip
    assert schedule_words({"schedule": BERLIN_MORNINGS}).startswith(
        "At 09:00, Monday through Friday (Europe/Berlin time"
    )


def test_the_run_page_shows_its_stages_with_lags_and_its_attempts_error_and_log(
    client, admin_superuser, queued_run
):
    run = queued_run(retry={"max_attempts": 1})
    attempt = claim(run, at=later(2))
    attempt_record_failure(attempt=attempt, spec=run.job_version.spec, retry_base=0,
                           ended="failed", error="Traceback (most recent call last):\n"
                           "RuntimeError: the disk is full", now=later(5), by="worker")  # fmt: skip
    run.refresh_from_db()
    assert run.state == "failed"
    page = client.get(f"/admin/jobs/run/{run.id}/change/").content.decode()
    assert 'id="run-timeline"' in page
    for stage in ("due", "created", "published", "started", "finished"):
        assert f'<span class="stage-name">{stage}</span>' in page
    assert "queue wait" in page and "run duration: 3.0 s" in page
    assert "RuntimeError: the disk is full" in page
    assert f'href="/admin/logs_app/logmanifest/attempt/{attempt.id}/"' in page
    assert f'href="/admin/jobs/job/{run.job_id}/change/"' in page  # breadcrumb and title
    # A failed run: Replay, and no Cancel (nothing to cancel).
    assert 'id="do-replay_runs"' in page and 'id="do-cancel_runs"' not in page
    # ... and the job's page lists it among its recent runs, linked.
    job_page = client.get(f"/admin/jobs/job/{run.job_id}/change/").content.decode()
    assert f'href="/admin/jobs/run/{run.id}/change/"' in job_page
    runs = client.get(f"/admin/jobs/run/?job__exact={run.job_id}")
    assert runs.status_code == 200 and str(run.id) in runs.content.decode()


def test_run_stages_measure_each_lag_from_the_stage_before():
    class Run:
        due_at = PINNED_NOW
        created_at = PINNED_NOW + dt.timedelta(milliseconds=4)
        published_at = None  # not known: the next lag counts from the last stage known
        started_at = PINNED_NOW + dt.timedelta(seconds=1)
        finished_at = None

    stages = {stage["name"]: stage for stage in run_stages(Run())}
    assert stages["created"]["lag_text"] == "4 ms"
    assert stages["published"]["lag"] is None and stages["finished"]["lag"] is None
    assert stages["started"]["lag"] == dt.timedelta(milliseconds=996)
    assert duration(dt.timedelta(seconds=245)) == "4 min 05 s"
    assert duration(dt.timedelta(hours=3, minutes=1)) == "3 h 01 min"
