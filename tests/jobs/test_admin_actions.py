"""The admin's actions (jobs/admin/actions.py): each through the API's service, audited
with the operator, with honest counts and the reason of every refusal, gated by the
models' permissions."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission

from dispatch.scheduler import SchedulerConfig, scheduler_run_once
from jobs.clock import db_now
from jobs.models import AuditEvent, Job, Run, RunKind
from jobs.services import job_cancel

pytestmark = pytest.mark.django_db

HOURLY = {"kind": "cron", "expression": "0 * * * *", "timezone": "UTC"}


def act(client, model: str, action: str, objects, *, url: str = "", **extra) -> tuple:
    """POST an action on `objects` from the model's list (or `url`); (response, message)."""
    response = client.post(
        url or f"/admin/jobs/{model}/",
        {"action": action, "_selected_action": [str(o.pk) for o in objects], **extra},
        follow=True,
    )
    return response, " ".join(str(m) for m in response.context["messages"])


def test_pause_and_resume_jobs_say_how_many_and_why_the_others_were_refused(
    client, admin_superuser, make_job, api
):
    a, b = make_job(name="a", schedule=HOURLY), make_job(name="b", schedule=HOURLY)
    gone = make_job(name="gone", schedule=HOURLY)
    job_cancel(job=gone, actor=admin_superuser, now=db_now())

    _, message = act(client, "job", "pause_jobs", [a, b, gone])
    assert message == (
        "Paused 2 of 3 selected jobs. Refused 1: only an active job can be paused, not a "
        "cancelled one ('gone')."
    )
    # The API sees what the admin did.
    assert api.get(f"/api/v1/jobs/{a.id}/").json()["state"] == "paused"
    _, message = act(client, "job", "resume_jobs", [a])
    assert message == "Resumed 1 of 1 selected jobs."
    _, message = act(client, "job", "resume_jobs", [a, b])
    assert message.startswith("Resumed 1 of 2 selected jobs. Refused 1: only a paused job")
    events = AuditEvent.objects.filter(job=a, action__in=["job.paused", "job.resumed"])
    assert {e.actor_label for e in events} == {"user:op"} and events.count() == 2


def test_cancel_from_a_filtered_list_counts_before_acting(client, admin_superuser, make_job):
    """The list was filtered on active jobs: once cancelled, the job leaves the filter, and
    a re-count after acting read 'refused: -1'."""
    job = make_job(name="only", schedule=HOURLY)
    filtered = "/admin/jobs/job/?state__exact=active"
    _, message = act(client, "job", "cancel_jobs", [job], url=filtered)
    assert message == "Cancelled 1 of 1 selected jobs."
    job.refresh_from_db()
    assert job.state == "cancelled"
    _, message = act(client, "job", "cancel_jobs", [job])
    assert message == (
        "Cancelled 0 of 1 selected jobs. Refused 1: a cancelled job cannot be cancelled ('only')."
    )


def test_trigger_jobs_queues_a_manual_run_of_each(client, admin_superuser, make_job):
    job, gone = make_job(name="t"), make_job(name="gone")
    job_cancel(job=gone, actor=admin_superuser, now=db_now())
    _, message = act(client, "job", "trigger_jobs", [job, gone])
    assert message == (
        "Triggered 1 of 2 selected jobs. Refused 1: a cancelled job cannot be triggered ('gone')."
    )
    run = Run.objects.get(job=job)
    assert (run.kind, run.state) == (RunKind.MANUAL, "queued")
    assert AuditEvent.objects.get(action="job.triggered", job=job).actor_label == "user:op"


def test_backfill_jobs_asks_for_the_range_validates_it_and_creates_nothing_twice(
    client, admin_superuser, make_job
):
    job = make_job(name="hourly", schedule=HOURLY)
    selection = {"action": "backfill_jobs", "_selected_action": [str(job.pk)]}
    page = client.post("/admin/jobs/job/", selection)
    assert page.status_code == 200 and b'name="start"' in page.content

    bad = client.post("/admin/jobs/job/", {**selection, "apply": "1", "start": "yesterday",
                                           "end": "2025-01-01T03:00:00Z"})  # fmt: skip
    assert bad.status_code == 400
    assert "is not an ISO 8601 date-time" in bad.content.decode()
    future = client.post("/admin/jobs/job/", {**selection, "apply": "1",
                                              "start": "2025-01-01T00:00:00Z",
                                              "end": "2999-01-01T00:00:00Z"})  # fmt: skip
    assert future.status_code == 400 and "Must not be in the future" in future.content.decode()
    assert not Run.objects.filter(job=job).exists()

    window = {"start": "2025-01-01T00:00:00Z", "end": "2025-01-01T03:00:00Z"}
    _, message = act(client, "job", "backfill_jobs", [job], apply="1", **window)
    assert message == "Backfilled 1 of 1 selected jobs (3 runs created, 0 already existed)."
    _, message = act(client, "job", "backfill_jobs", [job], apply="1", **window)
    assert message == "Backfilled 1 of 1 selected jobs (0 runs created, 3 already existed)."
    assert Run.objects.filter(job=job, kind=RunKind.BACKFILL).count() == 3
    assert AuditEvent.objects.filter(action="job.backfilled", actor=admin_superuser).count() == 2


def test_backfill_refuses_a_job_whose_range_is_too_large_and_does_the_others(
    client, admin_superuser, make_job
):
    minutely = make_job(name="minutely", schedule={"kind": "cron", "expression": "* * * * *"})
    daily = make_job(name="daily", schedule={"kind": "cron", "expression": "0 0 * * *"})
    window = {"start": "2025-01-01T00:00:00Z", "end": "2025-01-03T00:00:00Z"}
    _, message = act(client, "job", "backfill_jobs", [minutely, daily], apply="1", **window)
    assert message == (
        "Backfilled 1 of 2 selected jobs (2 runs created, 0 already existed). Refused 1: "
        "end: the range holds more than 1000 occurrences; backfill a shorter range. "
        "('minutely')."
    )


def test_cancel_and_replay_runs_with_the_reason_of_a_refused_replay(
    client, admin_superuser, make_job
):
    job = make_job(schedule={"kind": "once", "run_at": "2020-01-01T00:00:00Z"})
    scheduler_run_once(now=db_now(), config=SchedulerConfig())
    run = Run.objects.get(job=job)
    _, message = act(client, "run", "replay_runs", [run])
    assert message == (
        f"Replayed 0 of 1 selected runs. Refused 1: only a failed or cancelled run can be "
        f"replayed, not a queued one (run {str(run.id)[:8]})."
    )
    assert act(client, "run", "cancel_runs", [run])[1] == "Cancelled 1 of 1 selected runs."
    assert act(client, "run", "replay_runs", [run])[1] == "Replayed 1 of 1 selected runs."
    run.refresh_from_db()
    assert run.state == "queued"
    actions = list(
        AuditEvent.objects.filter(run=run).order_by("id").values_list("action", "actor_label")
    )
    assert actions == [("run.cancelled", "user:op"), ("run.replayed", "user:op")]


def test_an_action_from_a_job_page_returns_to_it(client, admin_superuser, make_job):
    job = make_job(schedule=HOURLY)
    page = f"/admin/jobs/job/{job.id}/change/"
    response = client.post(
        "/admin/jobs/job/",
        {"action": "pause_jobs", "_selected_action": [str(job.pk)], "next": page},
    )
    assert response.status_code == 302 and response["Location"] == page
    # Only a path of this site: anything else goes back to the list.
    response = client.post(
        "/admin/jobs/job/",
        {"action": "resume_jobs", "_selected_action": [str(job.pk)],
         "next": "https://elsewhere.example/"},
    )  # fmt: skip
    assert response.status_code == 302 and response["Location"] == "/admin/jobs/job/"


def test_each_action_needs_its_permission(client, make_job):
    job = make_job(schedule=HOURLY)
    staff = get_user_model().objects.create_user("viewer", password="pw", is_staff=True)
    staff.user_permissions.add(Permission.objects.get(codename="view_job"))
    client.force_login(staff)
    listing = client.get("/admin/jobs/job/")
    assert listing.status_code == 200 and b"pause_jobs" not in listing.content
    act(client, "job", "pause_jobs", [job])
    job.refresh_from_db()
    assert job.state == "active"

    staff.user_permissions.add(Permission.objects.get(codename="pause_job"))
    staff = get_user_model().objects.get(pk=staff.pk)  # permissions are cached per object
    client.force_login(staff)
    listing = client.get("/admin/jobs/job/").content
    assert b"pause_jobs" in listing and b"cancel_jobs" not in listing
    assert act(client, "job", "pause_jobs", [job])[1] == "Paused 1 of 1 selected jobs."
    act(client, "job", "cancel_jobs", [job])
    assert Job.objects.get(pk=job.pk).state == "paused"


def test_a_selection_past_the_limit_changes_nothing_and_says_so(
    client, admin_superuser, make_job, monkeypatch
):
    monkeypatch.setattr("jobs.admin.actions.MAX_SELECTED", 2)
    jobs = [make_job(name=f"j{i}", schedule=HOURLY) for i in range(3)]
    # Three ticked on the page ("all N matching" goes through a bulk operation instead:
    # tests/jobs/test_operations.py).
    _, message = act(client, "job", "pause_jobs", jobs)
    assert message == "Select at most 2 jobs at a time (more were selected); nothing was changed."
    assert set(Job.objects.values_list("state", flat=True)) == {"active"}
    _, message = act(client, "job", "pause_jobs", jobs[:2])
    assert message == "Paused 2 of 2 selected jobs."
