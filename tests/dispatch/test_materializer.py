"""The materializer (dispatch.materializer, through the scheduler pass): runs once per
occurrence, not before it is due, never for paused jobs, next_run_at advanced on the
schedule; and each job's policies (jobs.policies): misfire after an outage or a pause,
overlap with a run still active (loading a bounded number of them), jitter,
pause_after_failures, and the end of a schedule. Every pass is called directly with a
pinned clock."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import connection

from dispatch import materializer as materializer_module
from dispatch.materializer import OCCURRENCES_PER_JOB_PER_PASS
from dispatch.scheduler import SchedulerConfig, scheduler_run_once, scheduler_sleep_seconds
from jobs.models import (
    AttemptState,
    AuditEvent,
    Job,
    JobState,
    JobVersion,
    OutboxMessage,
    Run,
    RunKind,
    RunState,
)
from jobs.policies import run_jitter
from jobs.services import job_pause, job_resume, job_trigger
from jobs.transitions import attempt_fail, attempt_succeed, run_claim
from tests.factories import scheduled_runs
from tests.factories import scheduler_pass as run_once

T0 = dt.datetime(2030, 1, 1, 0, 0, tzinfo=dt.UTC)
HOURLY = {"kind": "cron", "expression": "0 * * * *", "timezone": "UTC"}
MINUTE = dt.timedelta(minutes=1)
HOUR = dt.timedelta(hours=1)


def at(hours: float = 0, minutes: float = 0, seconds: float = 0) -> dt.datetime:
    return T0 + dt.timedelta(hours=hours, minutes=minutes, seconds=seconds)


def runs_of(job) -> list[tuple[dt.datetime, str]]:
    return list(
        Run.objects.filter(job=job).order_by("scheduled_for").values_list("scheduled_for", "state")
    )


def claim(run: Run, now: dt.datetime):
    attempt = run_claim(run_id=run.id, worker="w", now=now, lease_seconds=3600)
    assert attempt is not None
    return attempt


def reload(obj):
    obj.refresh_from_db()
    return obj


# --- materialization: once per occurrence, when due, on the schedule ---------------------

CREATED = dt.datetime(2029, 12, 31, 12, 0, tzinfo=dt.UTC)
RUN_AT = dt.datetime(2030, 1, 1, 0, 0, tzinfo=dt.UTC)
NOW = RUN_AT + dt.timedelta(seconds=1)
CONFIG = SchedulerConfig()


def test_scheduler_twice_at_the_same_instant_creates_one_run(make_job):
    make_job(now=CREATED, schedule={"kind": "once", "run_at": RUN_AT.isoformat()})
    assert scheduler_run_once(now=NOW, config=CONFIG).runs_created == 1
    assert scheduler_run_once(now=NOW, config=CONFIG).runs_created == 0
    assert Run.objects.count() == OutboxMessage.objects.count() == 1


def test_scheduler_ignores_jobs_not_yet_due(make_job):
    job = make_job(now=CREATED, schedule={"kind": "once", "run_at": RUN_AT.isoformat()})
    assert scheduler_run_once(now=RUN_AT - dt.timedelta(seconds=1), config=CONFIG).runs_created == 0
    assert reload(job).next_run_at == RUN_AT
    assert Run.objects.count() == 0


def test_scheduler_clears_next_run_at_of_a_once_job(make_job):
    job = make_job(now=CREATED, schedule={"kind": "once", "run_at": RUN_AT.isoformat()})
    scheduler_run_once(now=NOW, config=CONFIG)
    assert reload(job).next_run_at is None


def test_scheduler_advances_a_cron_job_to_its_next_occurrence(make_job):
    """Berlin 09:00 in winter is 08:00Z; the run records the version that created it."""
    job = make_job(
        now=CREATED,
        schedule={"kind": "cron", "expression": "0 9 * * *", "timezone": "Europe/Berlin"},
    )
    first = dt.datetime(2030, 1, 1, 8, 0, tzinfo=dt.UTC)
    assert job.next_run_at == first
    assert scheduler_run_once(now=first, config=CONFIG).runs_created == 1
    assert reload(job).next_run_at == first + dt.timedelta(days=1)
    run = Run.objects.get(job=job)
    assert (run.scheduled_for, run.job_version.version) == (first, 1)
    assert run.idempotency_key.startswith(f"{job.id}:")


def test_scheduler_advances_an_interval_job_on_its_grid(make_job):
    job = make_job(now=CREATED, schedule={"kind": "interval", "every_seconds": 300})
    assert job.next_run_at == CREATED
    assert (
        scheduler_run_once(now=CREATED + dt.timedelta(seconds=10), config=CONFIG).runs_created == 1
    )
    assert reload(job).next_run_at == CREATED + dt.timedelta(seconds=300)
    # Not due again until the next step.
    assert (
        scheduler_run_once(now=CREATED + dt.timedelta(seconds=299), config=CONFIG).runs_created == 0
    )


def test_scheduler_skips_paused_jobs(make_job):
    job = make_job(now=CREATED, schedule={"kind": "once", "run_at": RUN_AT.isoformat()})
    Job.objects.filter(id=job.id).update(state="paused")
    assert scheduler_run_once(now=NOW, config=CONFIG).runs_created == 0


def test_scheduler_does_not_duplicate_a_run_when_next_run_at_is_rewound(make_job):
    """If next_run_at points at an occurrence that already has its run, it only advances."""
    job = make_job(
        now=CREATED, schedule={"kind": "cron", "expression": "0 0 * * *", "timezone": "UTC"}
    )
    scheduler_run_once(now=RUN_AT, config=CONFIG)
    Job.objects.filter(id=job.id).update(next_run_at=RUN_AT)
    assert scheduler_run_once(now=RUN_AT, config=CONFIG).runs_created == 0
    assert Run.objects.filter(job=job).count() == 1
    assert reload(job).next_run_at == RUN_AT + dt.timedelta(days=1)


@pytest.mark.parametrize("overlap", ["allow", "skip"])
def test_a_rewound_occurrence_with_its_run_neither_runs_again_nor_counts_as_new(make_job, overlap):
    """The runs' INSERT passes over an occurrence that has its run (ON CONFLICT); for an
    overlap policy the run found must not be taken for a new one, which would make the
    next occurrence, due in the same pass, be skipped behind it."""
    job = make_job(
        now=CREATED, overlap=overlap,
        schedule={"kind": "cron", "expression": "0 0 * * *", "timezone": "UTC"},
    )  # fmt: skip
    scheduler_run_once(now=RUN_AT, config=CONFIG)
    first = Run.objects.get(job=job)
    Run.objects.filter(id=first.id).update(state=RunState.SUCCEEDED, finished_at=RUN_AT)
    Job.objects.filter(id=job.id).update(next_run_at=RUN_AT)
    next_day = RUN_AT + dt.timedelta(days=1)
    result = scheduler_run_once(now=next_day + dt.timedelta(seconds=1), config=CONFIG)
    assert (result.runs_created, result.runs_skipped) == (1, 0)
    runs = Run.objects.filter(job=job).order_by("scheduled_for")
    assert [(run.scheduled_for, run.state) for run in runs] == [
        (RUN_AT, RunState.SUCCEEDED), (next_day, RunState.QUEUED),
    ]  # fmt: skip
    assert OutboxMessage.objects.filter(run__job=job).count() == 2


# --- misfire: the service was down for three hours -----------------------------------

# Created before midnight; the scheduler is down from 23:59 until 03:10, so the
# occurrences 00:00, 01:00, 02:00 and 03:00 are all later than the default 60 s grace.
OUTAGE_OVER = at(hours=3, minutes=10)


def hourly_job(make_job, **overrides):
    return make_job(now=T0 - dt.timedelta(minutes=30), schedule=HOURLY, **overrides)


def test_misfire_run_all_runs_every_missed_occurrence(make_job):
    job = hourly_job(make_job, misfire={"policy": "run_all"})
    result = run_once(OUTAGE_OVER)
    assert (result.runs_created, result.runs_skipped) == (4, 0)
    assert runs_of(job) == [(at(hours=h), RunState.QUEUED) for h in range(4)]
    assert OutboxMessage.objects.filter(run__job=job).count() == 4
    assert reload(job).next_run_at == at(hours=4)


def test_misfire_run_latest_runs_only_the_latest_and_records_the_rest(make_job):
    job = hourly_job(make_job, misfire={"policy": "run_latest"})
    result = run_once(OUTAGE_OVER)
    assert (result.runs_created, result.runs_skipped) == (1, 3)
    assert runs_of(job) == [
        (at(hours=0), RunState.SKIPPED),
        (at(hours=1), RunState.SKIPPED),
        (at(hours=2), RunState.SKIPPED),
        (at(hours=3), RunState.QUEUED),
    ]
    skipped = Run.objects.filter(job=job, state=RunState.SKIPPED)
    assert {run.skip_reason for run in skipped} == {
        "misfire: superseded by a later occurrence (policy run_latest)"
    }
    assert all(run.finished_at == OUTAGE_OVER for run in skipped)
    assert list(OutboxMessage.objects.values_list("run__scheduled_for", flat=True)) == [at(hours=3)]


def test_misfire_skip_records_every_missed_occurrence_as_skipped(make_job):
    job = hourly_job(make_job, misfire={"policy": "skip"})
    result = run_once(OUTAGE_OVER)
    assert (result.runs_created, result.runs_skipped) == (0, 4)
    assert runs_of(job) == [(at(hours=h), RunState.SKIPPED) for h in range(4)]
    reasons = (
        Run.objects.filter(job=job).order_by("scheduled_for").values_list("skip_reason", flat=True)
    )
    assert list(reasons)[0] == "misfire: missed by 11400s (policy skip)"
    assert not OutboxMessage.objects.exists()
    # Nothing is missed twice: the next pass has nothing to do until 04:00.
    assert run_once(OUTAGE_OVER + MINUTE).runs_skipped == 0
    assert reload(job).next_run_at == at(hours=4)


def test_misfire_grace_lets_a_recent_occurrence_run(make_job):
    job = hourly_job(make_job, misfire={"policy": "skip", "grace_seconds": 900})
    run_once(OUTAGE_OVER)
    assert runs_of(job)[-1] == (at(hours=3), RunState.QUEUED)
    assert [state for _, state in runs_of(job)[:-1]] == [RunState.SKIPPED] * 3


def test_an_occurrence_within_the_default_grace_is_not_a_misfire(make_job):
    job = hourly_job(make_job, misfire={"policy": "skip"})
    run_once(at(seconds=59))
    assert runs_of(job) == [(at(), RunState.QUEUED)]


def test_a_new_one_time_job_whose_run_at_passed_still_runs_under_skip(make_job):
    """Lateness counts from the job's creation: a catch-up, not a misfire."""
    job = make_job(
        now=at(hours=5),
        schedule={"kind": "once", "run_at": at().isoformat()},
        misfire={"policy": "skip"},
    )
    run_once(at(hours=5, seconds=1))
    assert runs_of(job) == [(at(), RunState.QUEUED)]


@pytest.mark.parametrize(
    ("policy", "last_state"), [("skip", RunState.SKIPPED), ("run_latest", RunState.QUEUED)]
)
def test_a_long_backlog_is_worked_off_in_bounded_passes(make_job, policy, last_state):
    """180 missed minutes: at most OCCURRENCES_PER_JOB_PER_PASS rows per pass; run_latest
    runs only the very latest occurrence, even across passes."""
    job = make_job(
        now=T0,
        schedule={"kind": "cron", "expression": "* * * * *", "timezone": "UTC"},
        misfire={"policy": policy, "grace_seconds": 0},
    )
    now = at(hours=3, seconds=-1)  # the 180 occurrences 00:00..02:59 are all missed
    first = run_once(now)
    assert first.runs_created + first.runs_skipped == OCCURRENCES_PER_JOB_PER_PASS
    second = run_once(now)
    assert second.runs_created + second.runs_skipped == 80
    assert first.runs_created + second.runs_created == (1 if policy == "run_latest" else 0)
    assert Run.objects.filter(job=job).count() == 180
    assert runs_of(job)[-1] == (at(hours=2, minutes=59), last_state)
    assert reload(job).next_run_at == at(hours=3)


def test_resume_applies_the_misfire_policy_to_what_was_missed_while_paused(make_job, user):
    job = hourly_job(make_job, misfire={"policy": "run_latest"})
    run_once(at())  # 00:00 runs on time
    assert job_pause(job=job, actor=user, now=at(minutes=30))
    assert run_once(at(hours=2, minutes=30)).runs_created == 0  # paused: nothing happens
    assert job_resume(job=reload(job), actor=user, now=at(hours=5, minutes=10))
    run_once(at(hours=5, minutes=10))
    assert runs_of(job) == [
        (at(), RunState.QUEUED),
        *[(at(hours=h), RunState.SKIPPED) for h in range(1, 5)],
        (at(hours=5), RunState.QUEUED),
    ]
    actions = list(AuditEvent.objects.filter(job=job).values_list("action", flat=True))
    assert {"job.paused", "job.resumed"} <= set(actions)


def test_pause_and_resume_are_refused_from_the_wrong_state(make_job, user):
    job = hourly_job(make_job)
    assert job_resume(job=job, actor=user, now=at()) is False
    assert job_pause(job=job, actor=user, now=at()) is True
    assert job_pause(job=reload(job), actor=user, now=at()) is False
    assert reload(job).state == JobState.PAUSED


# --- overlap: the previous run is still running at the next occurrence ---------------


def overlapping(make_job, policy: str):
    """An every-minute job whose first run is still running at the second occurrence."""
    job = make_job(now=T0, schedule={"kind": "interval", "every_seconds": 60}, overlap=policy)
    run_once(at())
    first = Run.objects.get(job=job)
    attempt = claim(first, at(seconds=1))
    result = run_once(at(minutes=1))
    second = Run.objects.get(job=job, scheduled_for=at(minutes=1))
    return job, reload(first), second, attempt, result


def test_overlap_skip_records_the_new_occurrence_as_skipped(make_job):
    job, first, second, _, result = overlapping(make_job, "skip")
    assert (first.state, second.state) == (RunState.RUNNING, RunState.SKIPPED)
    assert second.skip_reason == f"overlap: run {first.id} is still running (policy skip)"
    assert result.runs_skipped == 1
    assert not OutboxMessage.objects.filter(run=second).exists()


def test_overlap_allow_runs_both(make_job):
    job, first, second, _, _ = overlapping(make_job, "allow")
    assert (first.state, second.state) == (RunState.RUNNING, RunState.QUEUED)
    assert OutboxMessage.objects.filter(run=second).exists()


def test_overlap_buffer_one_holds_one_run_and_releases_it_when_the_active_one_ends(make_job):
    job, first, second, attempt, _ = overlapping(make_job, "buffer_one")
    assert second.state == RunState.PENDING
    assert not OutboxMessage.objects.filter(run=second).exists()
    # A third occurrence while one is already buffered is skipped.
    run_once(at(minutes=2))
    third = Run.objects.get(job=job, scheduled_for=at(minutes=2))
    assert third.state == RunState.SKIPPED
    assert third.skip_reason == "overlap: a run is already buffered (policy buffer_one)"
    assert reload(second).state == RunState.PENDING  # still held: the first still runs

    assert attempt_succeed(attempt=attempt, now=at(minutes=2, seconds=30))
    result = run_once(at(minutes=2, seconds=31))
    assert result.runs_released == 1
    assert reload(second).state == RunState.QUEUED
    assert OutboxMessage.objects.filter(run=second).count() == 1


def test_overlap_cancel_previous_cancels_the_running_run_and_queues_the_new(make_job):
    job, first, second, attempt, _ = overlapping(make_job, "cancel_previous")
    assert (first.state, second.state) == (RunState.CANCELLED, RunState.QUEUED)
    assert reload(attempt).state == AttemptState.CANCELLED
    event = AuditEvent.objects.get(run=first, action="run.cancelled")
    assert event.actor_label == "system:scheduler"
    # The cancelled attempt's late completion is refused.
    assert attempt_succeed(attempt=attempt, now=at(minutes=1, seconds=5)) is False


def test_overlap_in_a_catch_up_applies_between_the_new_runs_too(make_job):
    """Four missed hours under run_all with overlap skip: the first runs, and each later
    occurrence finds it still active."""
    job = hourly_job(make_job, misfire={"policy": "run_all"}, overlap="skip")
    run_once(OUTAGE_OVER)
    assert [state for _, state in runs_of(job)] == [RunState.QUEUED] + [RunState.SKIPPED] * 3


@pytest.mark.parametrize("policy", ["skip", "cancel_previous"])
def test_a_running_manual_run_is_not_the_active_run_of_overlap(make_job, user, policy):
    job = make_job(now=T0, schedule={"kind": "interval", "every_seconds": 60}, overlap=policy)
    manual = job_trigger(job=job, actor=user, now=at(seconds=-10))
    claim(manual, at(seconds=-5))
    run_once(at())
    assert Run.objects.get(job=job, kind="scheduled").state == RunState.QUEUED
    assert reload(manual).state == RunState.RUNNING


def test_manual_trigger_is_not_held_back_by_overlap(make_job, user):
    job, first, second, _, _ = overlapping(make_job, "skip")
    run = job_trigger(job=job, actor=user, now=at(minutes=1, seconds=10))
    assert (run.kind, run.state) == ("manual", RunState.QUEUED)
    assert OutboxMessage.objects.filter(run=run).exists()


# --- jitter -----------------------------------------------------------------------------


def test_jitter_is_deterministic_and_within_the_window():
    offsets = {run_jitter(f"job:{i}", 30) for i in range(500)}
    assert offsets <= {dt.timedelta(seconds=s) for s in range(31)}
    assert len(offsets) > 20  # it does spread
    assert run_jitter("job:1", 30) == run_jitter("job:1", 30)
    assert run_jitter("job:1", 0) == dt.timedelta(0)


def test_jitter_delays_publication_but_not_the_occurrence(make_job):
    job = make_job(
        now=T0, schedule={"kind": "interval", "every_seconds": 7200}, jitter_seconds=3600
    )
    run_once(at())
    run = Run.objects.get(job=job)
    offset = run_jitter(run.idempotency_key, 3600)
    assert offset > dt.timedelta(0)
    assert (run.scheduled_for, run.due_at, run.state) == (at(), at() + offset, RunState.PENDING)
    assert not OutboxMessage.objects.exists()
    assert scheduler_sleep_seconds(
        now=at(seconds=1), config=SchedulerConfig(poll_interval=1e6)
    ) == (offset.total_seconds() - 1)
    assert run_once(at() + offset - dt.timedelta(seconds=1)).runs_released == 0
    assert run_once(at() + offset).runs_released == 1
    assert reload(run).state == RunState.QUEUED
    assert OutboxMessage.objects.filter(run=run).count() == 1


# --- pause_after_failures ---------------------------------------------------------------


def fail_run(run: Run, now: dt.datetime) -> None:
    attempt = claim(run, now)
    assert attempt_fail(attempt=attempt, now=now, error="boom", retry_at=None)


def test_pause_after_failures_pauses_after_n_consecutive_failed_runs(make_job, user):
    job = make_job(
        now=T0, schedule={"kind": "interval", "every_seconds": 60}, pause_after_failures=2
    )
    for minute in range(2):
        run_once(at(minutes=minute))
        fail_run(
            Run.objects.get(job=job, scheduled_for=at(minutes=minute)),
            at(minutes=minute, seconds=5),
        )
    result = run_once(at(minutes=2))
    assert result.jobs_paused == 1
    assert reload(job).state == JobState.PAUSED
    assert not Run.objects.filter(job=job, scheduled_for=at(minutes=2)).exists()
    event = AuditEvent.objects.get(job=job, action="job.paused")
    assert (event.actor_label, event.data) == (
        "system:scheduler",
        {"reason": "2 consecutive failed runs"},
    )
    # A resume starts the count again: the old failures do not pause it at once.
    assert job_resume(job=reload(job), actor=user, now=at(minutes=3))
    assert run_once(at(minutes=3)).jobs_paused == 0
    assert reload(job).state == JobState.ACTIVE


def test_a_success_between_failures_resets_the_count(make_job):
    job = make_job(
        now=T0, schedule={"kind": "interval", "every_seconds": 60}, pause_after_failures=2
    )
    run_once(at())
    fail_run(Run.objects.get(job=job, scheduled_for=at()), at(seconds=5))
    run_once(at(minutes=1))
    second = Run.objects.get(job=job, scheduled_for=at(minutes=1))
    assert attempt_succeed(
        attempt=claim(second, at(minutes=1, seconds=1)), now=at(minutes=1, seconds=2)
    )
    run_once(at(minutes=2))
    fail_run(Run.objects.get(job=job, scheduled_for=at(minutes=2)), at(minutes=2, seconds=5))
    assert run_once(at(minutes=3)).jobs_paused == 0
    assert reload(job).state == JobState.ACTIVE


def test_pause_after_failures_is_judged_per_job_in_one_batch(make_job, user):
    """One pass over jobs of several limits and histories: each is judged on its own last
    runs (since its own resume), with one query for the whole batch."""
    every_minute = {"kind": "interval", "every_seconds": 60}
    jobs = {
        name: make_job(now=T0, name=name, schedule=every_minute, pause_after_failures=limit)
        for name, limit in [("two failed", 2), ("one of two failed", 2), ("one failed", 1),
                            ("three failed, limit 3", 3), ("resumed", 2), ("no policy", None)]
    }  # fmt: skip
    outcomes = {
        "two failed": ["failed", "failed"],
        "one of two failed": ["succeeded", "failed"],
        "one failed": ["succeeded", "failed"],
        "three failed, limit 3": ["failed", "failed"],
        "resumed": ["failed", "failed"],
        "no policy": ["failed", "failed"],
    }
    for minute in range(2):
        run_once(at(minutes=minute))
        for name, job in jobs.items():
            run = Run.objects.get(job=job, scheduled_for=at(minutes=minute))
            attempt = claim(run, at(minutes=minute, seconds=1))
            if outcomes[name][minute] == "failed":
                assert attempt_fail(attempt=attempt, now=at(minutes=minute, seconds=2),
                                    error="boom", retry_at=None)  # fmt: skip
            else:
                assert attempt_succeed(attempt=attempt, now=at(minutes=minute, seconds=2))
    resumed = jobs["resumed"]
    assert job_pause(job=resumed, actor=user, now=at(minutes=1, seconds=10))
    assert job_resume(job=reload(resumed), actor=user, now=at(minutes=1, seconds=20))

    result = run_once(at(minutes=2))

    paused = {name for name, job in jobs.items() if reload(job).state == JobState.PAUSED}
    assert paused == {"two failed", "one failed"}
    assert result.jobs_paused == 2
    for name, job in jobs.items():
        has_run = Run.objects.filter(job=job, scheduled_for=at(minutes=2)).exists()
        assert has_run == (name not in paused)


# --- the end of a schedule ----------------------------------------------------------------


def test_a_one_time_job_completes_with_its_run_s_terminal_transition(make_job):
    job = make_job(now=T0, schedule={"kind": "once", "run_at": at(minutes=1).isoformat()})
    run_once(at(minutes=1))
    assert reload(job).state == JobState.ACTIVE  # its run is still queued
    run = Run.objects.get(job=job)
    attempt = claim(run, at(minutes=1, seconds=1))
    assert run_once(at(minutes=1, seconds=2)).jobs_completed == 0
    assert attempt_succeed(attempt=attempt, now=at(minutes=1, seconds=3))
    # Completed by the run's own ending (run_ended_completes_job), not by a later scan.
    assert reload(job).state == JobState.COMPLETED
    assert run_once(at(minutes=1, seconds=4)).jobs_completed == 0
    assert AuditEvent.objects.filter(job=job, action="job.completed").count() == 1


def test_a_job_completes_with_the_last_of_its_active_runs(make_job, user):
    job = make_job(now=T0, schedule={"kind": "once", "run_at": at(minutes=1).isoformat()})
    run_once(at(minutes=1))
    scheduled = Run.objects.get(job=job)
    manual = job_trigger(job=job, actor=user, now=at(minutes=1))
    attempt = claim(scheduled, at(minutes=1, seconds=1))
    assert attempt_succeed(attempt=attempt, now=at(minutes=1, seconds=2))
    assert reload(job).state == JobState.ACTIVE  # the manual run is still queued
    attempt = claim(manual, at(minutes=1, seconds=3))
    assert attempt_fail(attempt=attempt, now=at(minutes=1, seconds=4), error="x", retry_at=None)
    assert reload(job).state == JobState.COMPLETED


def test_the_completer_is_the_safety_net_for_a_job_its_runs_did_not_complete(make_job):
    job = make_job(now=T0, schedule={"kind": "once", "run_at": at(minutes=1).isoformat()})
    run_once(at(minutes=1))
    run = Run.objects.get(job=job)
    with connection.cursor() as cursor:  # undone with the test's transaction
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")  # no pending checks: ALTER may run
        cursor.execute("ALTER TABLE jobs_run DISABLE TRIGGER run_ended_completes_job")
    assert attempt_succeed(attempt=claim(run, at(minutes=1, seconds=1)))
    assert reload(job).state == JobState.ACTIVE
    assert run_once(at(minutes=1, seconds=4)).jobs_completed == 1
    assert reload(job).state == JobState.COMPLETED
    assert AuditEvent.objects.filter(job=job, action="job.completed").count() == 1


def test_a_job_past_its_end_at_completes(make_job):
    job = make_job(
        now=T0,
        schedule={"kind": "interval", "every_seconds": 60},
        end_at=at(minutes=1, seconds=30).isoformat(),
        overlap="skip",
    )
    run_once(at(minutes=1))
    assert reload(job).next_run_at is None
    for run in Run.objects.filter(job=job, state=RunState.QUEUED):
        assert attempt_succeed(attempt=claim(run, at(minutes=2)), now=at(minutes=2))
    run_once(at(minutes=3))
    assert reload(job).state == JobState.COMPLETED


def test_a_paused_job_is_not_completed_and_not_materialized(make_job, user):
    job = make_job(now=T0, schedule={"kind": "once", "run_at": at(minutes=1).isoformat()})
    job_pause(job=job, actor=user, now=at())
    run_once(at(minutes=5))
    assert reload(job).state == JobState.PAUSED
    assert not Run.objects.filter(job=job).exists()
    assert Job.objects.get(id=job.id).next_run_at == at(minutes=1)


def test_a_job_whose_schedule_can_no_longer_be_evaluated_is_paused_not_completed(make_job):
    job = make_job(now=T0, schedule=HOURLY)
    # A hand edit of the job's current spec (the materializer reads its version's).
    gone = job.spec | {"schedule": HOURLY | {"timezone": "Gone/Zone"}}
    Job.objects.filter(id=job.id).update(spec=gone)
    JobVersion.objects.filter(job_id=job.id, version=job.version).update(spec=gone)
    run_once(at())
    run_once(at(minutes=1))
    job = reload(job)
    assert (job.state, job.next_run_at) == (JobState.PAUSED, None)
    assert AuditEvent.objects.get(job=job, action="job.paused").data == {"reason": "schedule error"}


def test_run_latest_does_not_run_a_missed_occurrence_when_a_later_one_is_due(make_job):
    """A pass's cap can end exactly on the last missed occurrence while later ones, within
    the grace, are already due: those supersede it."""
    job = make_job(
        now=T0,
        schedule={"kind": "cron", "expression": "* * * * *", "timezone": "UTC"},
        misfire={"policy": "run_latest", "grace_seconds": 1800},
    )
    now = at(hours=2, minutes=10)  # 00:00..01:39 are missed (100), 01:40..02:10 are not
    run_once(now)
    run_once(now)
    assert Run.objects.filter(job=job, state=RunState.SKIPPED).count() == 100
    queued = Run.objects.filter(job=job, state=RunState.QUEUED).order_by("scheduled_for")
    assert queued.count() == 31
    assert queued.first().scheduled_for == at(hours=1, minutes=40)


def test_the_failure_that_reaches_pause_after_failures_pauses_the_job_at_once(
    make_job, django_capture_on_commit_callbacks
):
    from jobs.models import AttemptState
    from jobs.outcomes import attempt_record_failure

    job = make_job(
        now=T0,
        schedule={"kind": "interval", "every_seconds": 60},
        pause_after_failures=2,
        retry={"max_attempts": 1},
    )
    for minute in range(2):
        run_once(at(minutes=minute))
        run = Run.objects.select_related("job_version").get(
            job=job, scheduled_for=at(minutes=minute)
        )
        with django_capture_on_commit_callbacks(execute=True):
            outcome = attempt_record_failure(
                attempt=claim(run, at(minutes=minute, seconds=1)),
                spec=run.job_version.spec,
                retry_base=0,
                ended=AttemptState.FAILED,
                error="boom",
                now=at(minutes=minute, seconds=2),
                by="worker:test",
            )
        assert outcome == "failed"
        # Paused by the second failure itself, not by a later scheduler pass.
        assert reload(job).state == (JobState.ACTIVE if minute == 0 else JobState.PAUSED)


# --- policies at their edges: a bounded load of active runs, a backlog, grace 0, a pause --


def _backlog(job, count: int) -> None:
    version = JobVersion.objects.get(job=job)
    Run.objects.bulk_create(
        Run(job=job, job_version=version, kind=RunKind.SCHEDULED, state=RunState.QUEUED,
            scheduled_for=T0 - dt.timedelta(seconds=i + 1), due_at=T0, created_at=T0,
            idempotency_key=f"{job.id}:backlog:{i}")
        for i in range(count)
    )  # fmt: skip


@pytest.mark.parametrize("overlap, most", [("allow", 0), ("skip", 100)])
def test_a_pass_loads_a_bounded_number_of_active_runs(make_job, monkeypatch, overlap, most):
    job = make_job(now=T0, schedule={"kind": "interval", "every_seconds": 1}, overlap=overlap)
    _backlog(job, 500)
    monkeypatch.setattr(materializer_module, "OVERLAP_RUNS_PER_JOB", 100)
    loaded = []
    original = Run.from_db.__func__
    monkeypatch.setattr(
        Run, "from_db", classmethod(lambda cls, *a: loaded.append(1) or original(cls, *a))
    )
    run_once(T0 + dt.timedelta(milliseconds=500))
    assert len(loaded) <= most
    new = Run.objects.get(job=job, scheduled_for=T0)
    assert new.state == (RunState.QUEUED if overlap == "allow" else RunState.SKIPPED)


def test_cancel_previous_still_cancels_the_newest_active_runs(make_job):
    job = make_job(
        now=T0, schedule={"kind": "interval", "every_seconds": 60}, overlap="cancel_previous"
    )
    _backlog(job, 3)
    run_once(T0 + dt.timedelta(seconds=1))
    assert sorted(state for _, state in scheduled_runs(job)) == ["cancelled"] * 3 + ["queued"]


def test_grace_zero_does_not_skip_an_occurrence_reached_on_time(make_job):
    job = make_job(
        now=T0 - dt.timedelta(minutes=1),
        schedule=HOURLY,
        misfire={"policy": "skip", "grace_seconds": 0},
    )
    run_once(T0 + dt.timedelta(milliseconds=5))
    run_once(T0 + HOUR + dt.timedelta(seconds=2))
    assert scheduled_runs(job) == [(T0, RunState.QUEUED), (T0 + HOUR, RunState.SKIPPED)]


def test_a_pending_run_created_before_a_pause_is_released(make_job, user):
    job = make_job(
        now=T0 - dt.timedelta(minutes=1),
        schedule={"kind": "once", "run_at": T0.isoformat()},
        jitter_seconds=3600,
    )
    run_once(T0)
    run = Run.objects.get(job=job)
    assert run.state == RunState.PENDING
    job_pause(job=job, actor=user, now=T0 + dt.timedelta(seconds=1))
    run_once(T0 + 2 * HOUR)
    run.refresh_from_db()
    assert run.state == RunState.QUEUED
    job.refresh_from_db()
    assert job.state == JobState.PAUSED
