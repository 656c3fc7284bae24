"""The admin pages (jobs.admin): browsing jobs, runs, attempts and the outbox, and the run
actions cancel and replay with the operator as actor."""

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


def test_admin_actions_cancel_and_replay_runs_with_the_operator_as_actor(client, make_job):
    from django.contrib.auth import get_user_model

    from dispatch.scheduler import SchedulerConfig, scheduler_run_once
    from jobs.clock import db_now
    from jobs.models import AuditEvent, Run

    job = make_job(schedule={"kind": "once", "run_at": "2020-01-01T00:00:00Z"})
    scheduler_run_once(now=db_now(), config=SchedulerConfig())
    run = Run.objects.get(job=job)
    staff = get_user_model().objects.create_superuser("op2", "op2@example.com", "pw")
    client.force_login(staff)

    def act(action: str) -> str:
        response = client.post(
            "/admin/jobs/run/",
            {"action": action, "_selected_action": [str(run.id)]},
            follow=True,
        )
        assert response.status_code == 200
        return " ".join(str(m) for m in response.context["messages"])

    assert "replayed: 0; refused (illegal in their state): 1" in act("replay_runs")
    assert "cancelled: 1; refused (illegal in their state): 0" in act("cancel_runs")
    assert "replayed: 1" in act("replay_runs")
    run.refresh_from_db()
    assert run.state == "queued"
    actions = list(
        AuditEvent.objects.filter(run=run).order_by("id").values_list("action", "actor_label")
    )
    assert actions == [("run.cancelled", "user:op2"), ("run.replayed", "user:op2")]
