"""Reads on jobs and runs: those that list jobs and runs always scoped to what the user
may see; the operator's figures (runs by state, due work overdue) read the whole system."""

from __future__ import annotations

import datetime as dt
import json
import re

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import F, Min, OuterRef, Prefetch, QuerySet, Subquery
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Coalesce, Greatest

from storage import tallies
from storage.metrics import tallies_sum

from .models import (
    Attempt,
    AuditEvent,
    Job,
    JobState,
    JobVersion,
    OutboxMessage,
    OutboxState,
    Run,
    RunState,
)
from .redaction import redact_change, redact_value
from .roles import user_is_operator
from .services import spec_diff

# A job's history lists at most this many versions and this many events, newest first.
HISTORY_VERSIONS_LIMIT = 100
HISTORY_EVENTS_LIMIT = 1000
# A value in a version's spec or diff whose JSON is longer than this is shown truncated
# (args and kwargs may be 64 KiB each), so that the history's size stays bounded.
HISTORY_VALUE_MAX_CHARS = 2000
# A run's history lists at most this many events, oldest first.
RUN_HISTORY_LIMIT = 500


def _sees_everything(user: AbstractBaseUser) -> bool:
    # Operators and superusers; `is_staff` alone opens the admin only (jobs.roles).
    return user_is_operator(user)


# A job's last outcome: its latest run that finished `succeeded` or `failed` (cancelled and
# skipped runs say nothing about the handler), read through run_job_finished_idx.
OUTCOME_STATES = (RunState.SUCCEEDED, RunState.FAILED)


def jobs_with_last_outcome(jobs: QuerySet[Job]) -> QuerySet[Job]:
    """`jobs` with `last_run_state` (succeeded | failed | None) and `last_run_at` (when that
    run finished) of each: one index probe per job (docs/semantics.md, "Last outcome")."""
    latest = Run.objects.filter(
        job=OuterRef("pk"), state__in=OUTCOME_STATES, finished_at__isnull=False
    ).order_by("-finished_at", "-id")[:1]
    return jobs.annotate(
        last_run_state=Subquery(latest.values("state")),
        last_run_at=Subquery(latest.values("finished_at")),
    )


def job_list(*, user: AbstractBaseUser, filters: dict | None = None) -> QuerySet[Job]:
    """The jobs `user` may see, deleted ones never, each with its last outcome. Filters:
    state, task, queue, label (a (key, value) pair), created_after (inclusive),
    created_before (exclusive)."""
    jobs = jobs_with_last_outcome(Job.objects.select_related("owner").filter(deleted_at=None))
    if not _sees_everything(user):
        jobs = jobs.filter(owner=user)
    filters = filters or {}
    for field in ("state", "task", "queue"):
        if filters.get(field):
            jobs = jobs.filter(**{field: filters[field]})
    if filters.get("label"):
        key, value = filters["label"]
        # A key transform rather than a `labels__<key>` lookup, which would read `__` in a
        # key as a path.
        jobs = jobs.alias(label_value=KeyTextTransform(key, "labels")).filter(label_value=value)
    if filters.get("created_after"):
        jobs = jobs.filter(created_at__gte=filters["created_after"])
    if filters.get("created_before"):
        jobs = jobs.filter(created_at__lt=filters["created_before"])
    return jobs


def job_get(*, user: AbstractBaseUser, job_id) -> Job | None:
    return job_list(user=user).filter(id=job_id).first()


def run_list(*, user: AbstractBaseUser, filters: dict | None = None) -> QuerySet[Run]:
    runs = Run.objects.select_related("job_version").prefetch_related(
        Prefetch("attempts", queryset=Attempt.objects.order_by("number")),
        "dependency_gates",  # upstream_runs (jobs.dependencies): one query per page
    )
    if not _sees_everything(user):
        runs = runs.filter(job__owner=user)
    runs = runs.filter(job__deleted_at=None)
    filters = filters or {}
    for field in ("job", "state", "kind"):
        if filters.get(field):
            runs = runs.filter(**{field: filters[field]})
    if filters.get("scheduled_after"):
        runs = runs.filter(scheduled_for__gte=filters["scheduled_after"])
    if filters.get("scheduled_before"):
        runs = runs.filter(scheduled_for__lt=filters["scheduled_before"])
    return runs


def run_get(*, user: AbstractBaseUser, run_id) -> Run | None:
    return run_list(user=user).filter(id=run_id).first()


def run_history(*, run: Run) -> list[AuditEvent]:
    """What happened to the run besides its attempts, oldest first: cancels, replays, lost
    and timed-out attempts, refused duplicates, reconciliation's repairs."""
    return list(AuditEvent.objects.filter(run=run).order_by("created_at", "id")[:RUN_HISTORY_LIMIT])


def _bounded(value):
    text = json.dumps(value, default=str)
    if len(text) <= HISTORY_VALUE_MAX_CHARS:
        return value
    return {"truncated": True, "chars": len(text), "preview": text[:200]}


def _bounded_spec(spec: dict) -> dict:
    return {key: _bounded(value) for key, value in spec.items()}


def job_history(*, job: Job, redacted: bool = False) -> dict:
    """The job's newest versions with their field-level diff to the one before, and the
    newest audit events of the job and of its runs (run-only events such as a lost attempt
    included), each with its actor; newest first, bounded in count and in size (a large
    value is truncated). `more_versions`/`more_events` say whether older ones exist.
    `redacted`: specs, diffs and audit data with their secrets masked (jobs.redaction), as
    anyone but the job's owner sees them."""
    shown = redact_value if redacted else (lambda value: value)
    shown_change = redact_change if redacted else (lambda change: change)
    versions = list(
        JobVersion.objects.filter(job=job)
        .select_related("created_by")
        .order_by("-version")[: HISTORY_VERSIONS_LIMIT + 1]
    )
    entries = []
    for newer, older in zip(versions, [*versions[1:], None], strict=True):
        changes = spec_diff(older.spec, newer.spec) if older else []
        entries.append(
            {
                "version": newer.version,
                "created_at": newer.created_at,
                "created_by": newer.created_by.get_username() if newer.created_by else None,
                "spec": _bounded_spec(shown(newer.spec)),
                "changes": [
                    {**change, "from": _bounded(change["from"]), "to": _bounded(change["to"])}
                    for change in map(shown_change, changes)
                ],
            }
        )
    # Two indexed reads rather than one OR across a join; merged, newest first.
    newest = ("-created_at", "-id")
    of_job = AuditEvent.objects.filter(job=job).order_by(*newest)[: HISTORY_EVENTS_LIMIT + 1]
    of_runs = AuditEvent.objects.filter(run__job=job).order_by(*newest)
    by_id = {event.id: event for event in [*of_job, *of_runs[: HISTORY_EVENTS_LIMIT + 1]]}
    events = sorted(by_id.values(), key=lambda e: (e.created_at, e.id), reverse=True)
    for event in events:
        data = shown(event.data)
        event.data = _bounded_spec(data) if isinstance(data, dict) else data
    return {
        "versions": entries[:HISTORY_VERSIONS_LIMIT],
        "more_versions": len(entries) > HISTORY_VERSIONS_LIMIT,
        "events": events[:HISTORY_EVENTS_LIMIT],
        "more_events": len(events) > HISTORY_EVENTS_LIMIT,
    }


# -- the operator's figures (/metrics, the dashboard): the whole system, no user scope ----

# A tally's or a counter's labels as stored: `kind="effect"`, `state="queued"`.
LABEL = re.compile(r'(\w+)="([^"]*)"')
# The tallies the triggers keep of the runs by state and of the outbox backlog.
RUN_TALLY, BACKLOG_TALLY = tallies.RUNS_BY_STATE, tallies.OUTBOX_BACKLOG


def oldest_overdue_seconds(*, now: dt.datetime, oldest_pending: dt.datetime | None = None) -> float:
    """How long the oldest due work not yet handed to the broker has waited: a due
    occurrence not yet materialized, counted from the job's acceptance (creation or
    resume) when that came later, as the discovery lag is (a job dated 2020 is not six
    years overdue; through job_due_idx's due range), or a run whose message waits in the
    outbox (a queue at its high-water mark, an owner at its limit), counted from when it
    became publishable. `oldest_pending`: that outbox row's created_at, when known."""
    due_since = Greatest("next_run_at", "created_at", Coalesce("resumed_at", "created_at"))
    oldest = Job.objects.filter(state=JobState.ACTIVE, next_run_at__lte=now).aggregate(
        at=Min(due_since)
    )["at"]
    if oldest_pending is None:
        oldest_pending = oldest_pending_outbox().first()
    waiting = [at for at in (oldest, oldest_pending) if at is not None]
    return max(0.0, (now - min(waiting)).total_seconds()) if waiting else 0.0


def oldest_queued_at() -> dt.datetime | None:
    """When the run queued longest ago was last stamped (queued, published late or
    republished), in two index probes: the oldest run not marked held back
    (run_queued_unheld_idx), and the oldest pending outbox row (outbox_pending_age_idx),
    written with its run's queueing, for the runs reconciliation marked held back."""
    unheld = (
        Run.objects.filter(state=RunState.QUEUED)
        .exclude(held_at=F("updated_at"))
        .order_by("updated_at", "id")
        .values_list("updated_at", flat=True)
        .first()
    )
    pending = oldest_pending_outbox().first()
    return min((at for at in (unheld, pending) if at is not None), default=None)


def oldest_pending_outbox() -> QuerySet:
    """The pending outbox rows' created_at, oldest first: its first is one probe of
    outbox_pending_age_idx, however long the backlog."""
    return (
        OutboxMessage.objects.filter(state=OutboxState.PENDING)
        .order_by("created_at")
        .values_list("created_at", flat=True)
    )


def runs_by_state_and_backlog() -> tuple[dict[str, int], int]:
    """(runs by state, outbox rows pending): the tallies the triggers keep (a few dozen
    rolled-up rows and the deltas since the last roll-up, however many runs)."""
    rows = tallies_sum(names=[RUN_TALLY, BACKLOG_TALLY])
    runs, backlog = {}, 0
    for name, labels, count, _total in rows:
        if name == BACKLOG_TALLY:
            backlog = int(count)
        else:
            runs[dict(LABEL.findall(labels))["state"]] = int(count)
    return runs, backlog


def dead_letters_total() -> int:
    """Runs that ended failed, ever: counted by a trigger as each one fails, so a replay
    or retention's delete never lowers it (scheduler_dead_letter_total)."""
    return sum(row.count for row in tallies_sum(names=[tallies.DEAD_LETTERS]))
