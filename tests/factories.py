"""Every builder of test data: job bodies and specs, jobs, queued runs and running attempts,
users and their API tokens. Fixtures (tests/conftest.py) and tests call these; no test
module keeps a copy of its own."""

from __future__ import annotations

import datetime as dt

from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

# The instant in-process tests pin their clocks to (far from any real clock's reach).
PINNED_NOW = dt.datetime(2030, 1, 1, 12, 0, tzinfo=dt.UTC)

# The run_at of a default job body.
RUN_AT = "2030-01-01T00:00:00Z"


# --- users and tokens ------------------------------------------------------------------


def owner(name: str = "faults"):
    """The user named `name`, created on first use."""
    return get_user_model().objects.get_or_create(username=name)[0]


def superuser(name: str, password: str = "pw"):
    """A superuser: every model permission, the admin's actions included."""
    return get_user_model().objects.create_superuser(name, f"{name}@example.com", password)


def operator(name: str = "operator"):
    """A member of the `operators` group named `name`, created on first use."""
    from django.contrib.auth.models import Group

    from jobs.roles import OPERATORS_GROUP

    user = owner(name)
    user.groups.add(Group.objects.get_or_create(name=OPERATORS_GROUP)[0])
    return user


def token_for(user) -> str:
    """The key of a new API token of the user (the database keeps only its hash)."""
    from jobs.tokens import token_create

    return token_create(owner=user, now=dt.datetime.now(dt.UTC))[1]


def api_client(user) -> APIClient:
    """An in-process API client authenticated by the user's token."""
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token_for(user)}")
    return client


# --- job bodies and specs --------------------------------------------------------------


def job_body(**overrides) -> dict:
    """A valid job body as a client sends it (not validated), with `overrides` applied."""
    return {
        "name": "nightly report",
        "task": "tests.record",
        "schedule": {"kind": "once", "run_at": RUN_AT},
        **overrides,
    }


def job_spec(**overrides) -> dict:
    """A valid job body, validated as the API would, with `overrides` applied first."""
    from jobs.api.validation import JobSpecSerializer

    # run_at is not kept to its window against the real clock: tests pin their own.
    serializer = JobSpecSerializer(
        data=job_body(**{"name": "test job", **overrides}), context={"unchanged": {"schedule"}}
    )
    serializer.is_valid(raise_exception=True)
    return dict(serializer.validated_data)


# --- jobs, runs and attempts -----------------------------------------------------------


def make_job(owner, *, now: dt.datetime | None = None, **overrides):
    """A job of `owner` created through the service layer at `now` (default: the real now)."""
    from jobs.services import job_create

    return job_create(owner=owner, spec=job_spec(**overrides), now=now or dt.datetime.now(dt.UTC))


def one_time_job(
    *, task: str, due_in: float = 0.0, due_at: dt.datetime | None = None, args=(), **overrides
):
    """A one-time job of `owner()` due `due_in` seconds from the real now (or at `due_at`:
    jobs made one by one on a loaded machine then still fall due together)."""
    now = dt.datetime.now(dt.UTC)
    due_at = due_at or now + dt.timedelta(seconds=due_in)
    return make_job(
        owner(),
        now=now,
        task=task,
        args=list(args),
        schedule={"kind": "once", "run_at": due_at.isoformat()},
        **overrides,
    )


def queued_run(
    owner,
    *,
    run_at: dt.datetime = PINNED_NOW,
    created: dt.datetime | None = None,
    materialize_at: dt.datetime | None = None,
    **overrides,
):
    """A one-time job due at `run_at` (created at `created`, default a minute before),
    materialized by the scheduler at `materialize_at` (default `run_at`): its run is queued,
    with its outbox row pending."""
    from dispatch.scheduler import SchedulerConfig, scheduler_run_once
    from jobs.models import Run

    job = make_job(
        owner,
        now=created or run_at - dt.timedelta(minutes=1),
        schedule={"kind": "once", "run_at": run_at.isoformat()},
        **overrides,
    )
    scheduler_run_once(now=materialize_at or run_at, config=SchedulerConfig())
    return Run.objects.select_related("job_version").get(job=job)


def running_attempt(queued_run, **overrides):
    """A claimed run's attempt, running (claimed at PINNED_NOW); `queued_run` is the
    fixture's maker."""
    from jobs.transitions import run_claim

    run = queued_run(**overrides)
    return run_claim(run_id=run.id, worker="test", now=PINNED_NOW, lease_seconds=300)


def scheduler_pass(now: dt.datetime):
    """One pass of the scheduler with a pinned clock."""
    from dispatch.scheduler import SchedulerConfig, scheduler_run_once

    return scheduler_run_once(now=now, config=SchedulerConfig())


def scheduled_runs(job) -> list[tuple[dt.datetime, str]]:
    """(scheduled_for, state) of the job's scheduled runs, in order."""
    from jobs.models import Run, RunKind

    return list(
        Run.objects.filter(job=job, kind=RunKind.SCHEDULED)
        .order_by("scheduled_for")
        .values_list("scheduled_for", "state")
    )


def job_patch(job, user, now, **fields):
    """PATCH a job through the services, validated as the API would."""
    from jobs.api.validation import job_patched_spec
    from jobs.services import job_update

    job.refresh_from_db()
    spec = job_patched_spec(spec=job.spec, patch=fields)
    assert job_update(job=job, spec=spec, expected_version=job.version, actor=user, now=now)
    job.refresh_from_db()
    return job


# --- a run by hand: its claim, its publication, its snapshot, its API actions ----------

# The lease of `claim`'s attempts.
CLAIM_LEASE_SECONDS = 30.0


def later(seconds: float) -> dt.datetime:
    """PINNED_NOW plus `seconds`."""
    return PINNED_NOW + dt.timedelta(seconds=seconds)


def claim(run, *, at: dt.datetime = PINNED_NOW, timeout: float | None = None):
    """The run's next attempt, claimed by worker-a at `at` for CLAIM_LEASE_SECONDS."""
    from jobs.transitions import run_claim

    attempt = run_claim(
        run_id=run.id,
        worker="worker-a",
        now=at,
        lease_seconds=CLAIM_LEASE_SECONDS,
        timeout_seconds=timeout,
    )
    assert attempt is not None
    return attempt


def publish(run, *, at: dt.datetime = PINNED_NOW) -> None:
    """What the relay does once the broker confirmed the run's pending rows: deletes them.
    The run is made queued (hence published) at `at`, the instant from which
    reconciliation counts a published run's wait."""
    from jobs.models import OutboxMessage, Run

    assert OutboxMessage.objects.filter(run=run).delete()[0]
    assert Run.objects.filter(id=run.id).update(updated_at=at)


def run_snapshot(run_id) -> tuple[dict, list[dict], list[dict]]:
    """Everything the run, its attempts and its outbox rows hold, to show that nothing
    changed."""
    from jobs.models import Attempt, OutboxMessage, Run

    return (
        Run.objects.filter(id=run_id).values().get(),
        list(Attempt.objects.filter(run_id=run_id).order_by("number").values()),
        list(OutboxMessage.objects.filter(run_id=run_id).order_by("id").values()),
    )


def api_run_cancel(api, run):
    """POST the run's cancel."""
    return api.post(f"/api/v1/runs/{run.id}/cancel/")


def api_run_replay(api, run):
    """POST the run's replay."""
    return api.post(f"/api/v1/runs/{run.id}/replay/")


# --- run logs --------------------------------------------------------------------------


def stored_lines(run) -> list[dict]:
    """The run's stored log lines, attempt by attempt, in order."""
    from logs_app.models import LogChunk
    from logs_app.store import chunk_lines

    lines = []
    for chunk in LogChunk.objects.filter(run=run).order_by("attempt__number", "sequence"):
        lines += chunk_lines(chunk)
    return lines
