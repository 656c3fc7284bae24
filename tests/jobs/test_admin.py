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


def test_operators_set_an_owner_s_limit_and_see_its_active_runs(client, user, operator):
    """OwnerLimit in the admin: an operator sets an owner's limit (audited) and sees its
    runs in the broker or running; staff outside the operators group do not see it."""
    from django.contrib.auth.models import Permission

    from jobs.models import ActiveRun, AuditEvent, OwnerLimit
    from tests.factories import queued_run

    operator.is_staff = True
    operator.save()
    client.force_login(operator)
    page = client.post("/admin/jobs/ownerlimit/add/", {"owner": user.id, "max_active_runs": 3})
    assert page.status_code == 302, page.content.decode()[:2000]
    assert OwnerLimit.objects.get(owner=user).max_active_runs == 3
    event = AuditEvent.objects.get(action="owner.limit_set")
    assert (event.actor, event.data) == (operator, {"owner": user.id, "max_active_runs": 3})
    run = queued_run(user)
    ActiveRun.objects.create(run=run, owner=user, published_at=NOW)
    listing = client.get("/admin/jobs/ownerlimit/").content.decode()
    assert 'class="field-active_runs">1<' in listing
    assert 'class="field-waiting_runs">1<' in listing

    staff = get_user_model().objects.create_user("staff", is_staff=True)
    staff.user_permissions.set(Permission.objects.filter(codename__endswith="ownerlimit"))
    client.force_login(staff)
    assert client.get("/admin/jobs/ownerlimit/").status_code == 403


def test_an_owner_s_limit_is_at_least_one(client, user, operator):
    """0 would hold the owner's runs back forever with nothing to show why."""
    from jobs.models import AuditEvent, OwnerLimit

    operator.is_staff = True
    operator.save()
    client.force_login(operator)
    page = client.post("/admin/jobs/ownerlimit/add/", {"owner": user.id, "max_active_runs": 0})
    assert page.status_code == 200
    assert "greater than or equal to 1" in page.content.decode()
    assert not OwnerLimit.objects.exists()
    assert not AuditEvent.objects.filter(action="owner.limit_set").exists()
    assert (
        client.post(
            "/admin/jobs/ownerlimit/add/", {"owner": user.id, "max_active_runs": 1}
        ).status_code
        == 302
    )


def test_an_owner_s_waiting_runs_are_counted_up_to_a_cap(client, user, operator, monkeypatch):
    from jobs.admin import model_admins as jobs_admin
    from jobs.models import OwnerLimit
    from tests.factories import queued_run

    monkeypatch.setattr(jobs_admin, "WAITING_RUNS_SHOWN", 2)
    OwnerLimit.objects.create(owner=user, max_active_runs=1)
    operator.is_staff = True
    operator.save()
    client.force_login(operator)
    for waiting in (1, 2, "2+"):
        queued_run(user)
        listing = client.get("/admin/jobs/ownerlimit/").content.decode()
        assert f'class="field-waiting_runs">{waiting}<' in listing
