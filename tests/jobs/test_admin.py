"""The admin pages (jobs.admin): browsing jobs, runs, attempts and the outbox. The actions
are tested in test_admin_actions.py."""

import datetime as dt

from django.contrib.auth import get_user_model

from dispatch.scheduler import SchedulerConfig, scheduler_run_once
from jobs.models import Run

NOW = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


def test_admin_browses_jobs_runs_and_attempts(client, make_job):
    job = make_job(
        now=NOW - dt.timedelta(minutes=1), schedule={"kind": "once", "run_at": NOW.isoformat()}
    )
    scheduler_run_once(now=NOW, config=SchedulerConfig())
    run = Run.objects.get(job=job)
    staff = get_user_model().objects.create_superuser("op", "op@example.com", "pw")
    client.force_login(staff)
    for url in (
        "/admin/jobs/job/",
        f"/admin/jobs/job/{job.id}/change/",
        "/admin/jobs/run/",
        f"/admin/jobs/run/{run.id}/change/",
        "/admin/jobs/attempt/",
        "/admin/jobs/outboxmessage/",
    ):
        assert client.get(url).status_code == 200, url
    # The outbox's page before it moved from the dispatch app to jobs.
    assert client.get("/admin/dispatch/outboxmessage/", follow=True).status_code == 200
