"""Retention of finished runs (dispatch.pruner, jobs.retention), with a pinned clock: old
finished runs go with their attempts, outbox rows, effects, audit events and logs; nothing
unfinished goes, nor the newest runs a job's policies need; batches are bounded; the
candidates are found through run_finished_idx."""

from __future__ import annotations

import datetime as dt
import threading
import time

import pytest
from django.core.files.storage import storages
from django.db import connection, transaction

from dispatch.pruner import PrunerConfig, pruner_run_once
from jobs.clock import db_now
from jobs.models import (
    Attempt,
    AttemptState,
    AuditEvent,
    Effect,
    Job,
    JobState,
    OutboxMessage,
    Run,
    RunKind,
    RunState,
    ThrottleWindow,
)
from jobs.schedules import backfill_occurrences
from jobs.services import job_backfill, job_trigger
from logs_app.models import LogChunk, LogManifest
from scheduler_project.settings.env import env_days
from storage.retention import EXPIRED_RUNS
from storage.throttle import throttle_hit
from tests import factories
from tests.factories import make_job
from tests.logs.test_retention import attempt_with_logs, stored_names
from tests.threads import in_thread

NOW = dt.datetime(2030, 1, 1, 9, 0, tzinfo=dt.UTC)
DAY = dt.timedelta(days=1)
KEEP_30_DAYS = PrunerConfig(run_retention_days=30)


def finished_runs(job: Job, user, *ends: dt.datetime, state=RunState.FAILED) -> list[Run]:
    """Manual runs of `job`, one per instant, each finished `state` then (scheduled a
    minute before)."""
    runs = []
    for end in ends:
        run = job_trigger(job=job, actor=user, now=end - dt.timedelta(minutes=1))
        Run.objects.filter(id=run.id).update(state=state, finished_at=end)
        runs.append(run)
    return runs


def exists(run: Run) -> bool:
    return Run.objects.filter(id=run.id).exists()


@pytest.mark.django_db
def test_old_finished_runs_go_with_everything_that_hangs_off_them(queued_run):
    old = attempt_with_logs(queued_run, finished=NOW - 31 * DAY)
    recent = attempt_with_logs(queued_run, finished=NOW - 29 * DAY)
    (old_file,) = stored_names(old)
    for attempt, finished in ((old, NOW - 31 * DAY), (recent, NOW - 29 * DAY)):
        Run.objects.filter(id=attempt.run_id).update(finished_at=finished)
        Effect.objects.create(run_id=attempt.run_id, name="charge", attempt_number=1,
                              fencing_token=1)  # fmt: skip
        AuditEvent.objects.create(actor_label="system:test", action="run.x", run_id=attempt.run_id)
    # One-time jobs that ran: completed, so none of their runs is kept for their policies.
    Job.objects.update(state=JobState.COMPLETED)
    children = (Attempt, OutboxMessage, Effect, AuditEvent, LogChunk)
    rows = {model: model.objects.filter(run_id=old.run_id).count() for model in children}
    assert all(rows.values()), rows

    result = pruner_run_once(now=NOW, config=KEEP_30_DAYS)

    assert result.runs_pruned == 1 and not result.batch_full
    assert not Run.objects.filter(id=old.run_id).exists()
    for model in children:
        assert not model.objects.filter(run_id=old.run_id).exists(), model
    assert not LogManifest.objects.filter(attempt_id=old.id).exists()
    assert not storages["scheduler_logs"].exists(old_file)
    assert result.run_rows_pruned == 1 + sum(rows.values()) + 1  # the run, ..., the manifest
    # The recent one is whole; its job version stays, as does the pruned run's job.
    assert Run.objects.filter(id=recent.run_id).exists()
    assert all(model.objects.filter(run_id=recent.run_id).exists() for model in children)
    assert all(storages["scheduler_logs"].exists(name) for name in stored_names(recent))
    assert Job.objects.count() == 2
    assert pruner_run_once(now=NOW, config=KEEP_30_DAYS).runs_pruned == 0


@pytest.mark.django_db
def test_nothing_unfinished_is_pruned_however_old(user):
    job = make_job(user, now=NOW - 200 * DAY)
    long_ago = NOW - 100 * DAY
    runs = {
        state: job_trigger(job=job, actor=user, now=long_ago + n * dt.timedelta(minutes=1))
        for n, state in enumerate(RunState.values)
    }
    for state, run in runs.items():
        Run.objects.filter(id=run.id).update(
            state=state, updated_at=long_ago, next_attempt_at=NOW + DAY,
            finished_at=long_ago if state in {"succeeded", "failed", "cancelled", "skipped"}
            else None,
        )  # fmt: skip
    # Cancelled while it ran, and its worker has not seen it yet: its attempt still runs.
    cancelled_running = finished_runs(job, user, long_ago, state=RunState.CANCELLED)[0]
    Attempt.objects.create(
        run=cancelled_running, number=1, fencing_token=1, state=AttemptState.RUNNING,
        lease_expires_at=long_ago, heartbeat_at=long_ago, started_at=long_ago,
    )  # fmt: skip
    # A job that will not run again: no run of it is kept for its policies.
    Job.objects.filter(id=job.id).update(state=JobState.CANCELLED)

    result = pruner_run_once(now=NOW, config=KEEP_30_DAYS)

    assert result.runs_pruned == 4  # the four terminal ones
    for state in ("pending", "queued", "running", "retry_wait"):
        assert exists(runs[state]), state
    for state in ("succeeded", "failed", "cancelled", "skipped"):
        assert not exists(runs[state]), state
    assert exists(cancelled_running)


@pytest.mark.django_db
def test_the_newest_runs_a_job_may_still_need_are_kept(user):
    ends = [NOW - (40 - n) * DAY for n in range(5)]  # all older than the retention
    plain = make_job(user, now=NOW - 60 * DAY)
    failing = make_job(user, now=NOW - 60 * DAY, pause_after_failures=3)
    paused = make_job(user, now=NOW - 60 * DAY)
    deleted = make_job(user, now=NOW - 60 * DAY)
    completed = make_job(user, now=NOW - 60 * DAY)
    runs = {job.id: finished_runs(job, user, *ends) for job in (plain, failing, paused, deleted,
                                                                 completed)}  # fmt: skip
    # Active only by its older run: a newer unfinished run does not count as its newest.
    Run.objects.filter(id=runs[plain.id][-1].id).update(state=RunState.QUEUED, finished_at=None)
    Job.objects.filter(id=paused.id).update(state=JobState.PAUSED)
    Job.objects.filter(id=deleted.id).update(state=JobState.CANCELLED, deleted_at=NOW - 50 * DAY)
    Job.objects.filter(id=completed.id).update(state=JobState.COMPLETED)

    pruner_run_once(now=NOW, config=KEEP_30_DAYS)

    def kept(job):
        return [run for run in runs[job.id] if exists(run)]

    # pause_after_failures judges the last N finished runs: they stay, whatever their age.
    assert kept(failing) == runs[failing.id][-3:]
    assert kept(plain) == runs[plain.id][-2:]  # the queued one, and the newest finished
    assert kept(paused) == runs[paused.id][-1:]
    assert kept(deleted) == kept(completed) == []


@pytest.mark.django_db
def test_skipped_and_cancelled_runs_never_push_a_failure_its_policy_still_counts(user):
    """pause_after_failures counts failed and succeeded runs only (jobs.services): a
    monthly job's old failure stays while newer runs were only skipped or cancelled, so
    the next failure still pauses the job as it would have without pruning."""
    job = make_job(user, now=NOW - 200 * DAY, pause_after_failures=2)
    (failure,) = finished_runs(job, user, NOW - 90 * DAY)
    cancelled = finished_runs(job, user, NOW - 60 * DAY, state=RunState.CANCELLED)
    (skipped,) = finished_runs(job, user, NOW - 35 * DAY, state=RunState.SKIPPED)

    pruner_run_once(now=NOW, config=KEEP_30_DAYS)

    assert exists(failure)  # still one of the job's last two judged runs
    assert exists(skipped)  # the job's newest run, which the API shows
    assert not exists(cancelled[0])  # neither: it goes


@pytest.mark.django_db
def test_runs_go_in_bounded_batches_oldest_first(user):
    job = make_job(user, now=NOW - 60 * DAY)
    runs = finished_runs(job, user, *(NOW - (40 - n) * DAY for n in range(8)))
    config = PrunerConfig(run_retention_days=30, run_batch_size=2, run_batches=2)

    first = pruner_run_once(now=NOW, config=config)
    assert (first.runs_pruned, first.batch_full) == (4, True)
    assert [exists(run) for run in runs] == [False] * 4 + [True] * 4
    second = pruner_run_once(now=NOW, config=config)
    assert (second.runs_pruned, second.batch_full) == (3, False)  # the newest stays
    assert [exists(run) for run in runs] == [False] * 7 + [True]


@pytest.mark.django_db
def test_the_throttle_table_holds_the_current_windows_not_every_key_ever_seen():
    """Login attempts from ever new addresses (one row each): the pruner deletes each ended
    window's rows, in batches of `batch_size`, so the table never holds more than the
    keys of one window however many went before."""
    config = PrunerConfig(batch_size=100)
    sizes, batches = [], []
    for round_ in range(5):
        for address in range(250):
            throttle_hit(key=f"throttle_admin_login_10.{round_}.0.{address}", window_seconds=60)
        sizes.append(ThrottleWindow.objects.count())
        after_the_window = db_now() + dt.timedelta(seconds=61)
        while True:  # as the loop does: at once again while a batch was full
            result = pruner_run_once(now=after_the_window, config=config)
            batches.append(result.throttle_windows_pruned)
            if not result.batch_full:
                break
    assert sizes == [250] * 5  # not 250, 500, ... 1,250
    assert ThrottleWindow.objects.count() == 0
    assert max(batches) == 100 and sum(batches) == 1250
    # A window not ended yet stays, its count with it.
    throttle_hit(key="throttle_user_1", window_seconds=86_400)
    assert pruner_run_once(now=db_now(), config=config).throttle_windows_pruned == 0
    assert ThrottleWindow.objects.get().hits == 1


@pytest.mark.django_db(transaction=True)
def test_a_run_another_transaction_holds_is_passed_over(user):
    """A replay (or any transition) that holds the run's row: the pruner takes the others
    and leaves that one to a later pass, never deleting under it."""
    job = make_job(user, now=NOW - 60 * DAY)
    held, other, _newest = finished_runs(job, user, NOW - 40 * DAY, NOW - 39 * DAY, NOW - DAY)
    locked, release = threading.Event(), threading.Event()

    def hold():
        with transaction.atomic():
            Run.objects.select_for_update().get(id=held.id)
            locked.set()
            release.wait(30)

    thread = in_thread(hold)
    assert locked.wait(30)
    try:
        assert pruner_run_once(now=NOW, config=KEEP_30_DAYS).runs_pruned == 1
        assert exists(held) and not exists(other)
    finally:
        release.set()
        thread.join(30)
    assert pruner_run_once(now=NOW, config=KEEP_30_DAYS).runs_pruned == 1
    assert not exists(held)


@pytest.mark.django_db
def test_the_candidates_are_read_through_the_finished_runs_index(user):
    job = make_job(user, now=NOW - 60 * DAY)
    finished_runs(job, user, NOW - 40 * DAY, NOW - DAY)
    with connection.cursor() as cursor:
        # Tiny tables favour a sequential scan; without it the index must be usable, which
        # it is only while the query's states imply the partial index's predicate.
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute(
            "EXPLAIN " + EXPIRED_RUNS,
            {"cutoff": NOW - 30 * DAY, "limit": 1000},
        )
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "run_finished_idx" in plan, plan


def test_retention_config_and_setting_refuse_what_is_not_a_positive_number(monkeypatch):
    with pytest.raises(ValueError, match="run_retention_days must be greater than 0"):
        PrunerConfig(run_retention_days=0)
    for bad in ("0", "-1", "nan", "inf", "thirty"):
        monkeypatch.setenv("SCHEDULER_RUN_RETENTION_DAYS", bad)
        with pytest.raises(ValueError, match="SCHEDULER_RUN_RETENTION_DAYS"):
            env_days("SCHEDULER_RUN_RETENTION_DAYS", "30")
    monkeypatch.setenv("SCHEDULER_RUN_RETENTION_DAYS", "0.00005")
    assert env_days("SCHEDULER_RUN_RETENTION_DAYS", "30") == 0.00005
    monkeypatch.delenv("SCHEDULER_RUN_RETENTION_DAYS")
    assert env_days("SCHEDULER_RUN_RETENTION_DAYS", "30") == 30.0


@pytest.mark.slow
def test_soak_the_hot_tables_stay_bounded_while_runs_keep_succeeding(stack, report_figure):
    """Five interval jobs fire every second for about 40 s against a retention of 3 s, the
    pruner every 0.5 s: the run, attempt and outbox tables stay bounded while runs keep
    succeeding; a long run and a run waiting an hour for its retry, both older than the
    retention, survive."""
    stack.scheduler("scheduler", "--prune-interval", "0.5",
                    SCHEDULER_RUN_RETENTION_DAYS=str(3 / 86400))  # fmt: skip
    stack.relay()
    stack.worker(concurrency=3)
    owner = factories.owner()
    now = dt.datetime.now(dt.UTC)
    for n in range(5):
        make_job(owner, now=now, name=f"every second {n}", task="tests.record",
                 schedule={"kind": "interval", "every_seconds": 1})  # fmt: skip
    long_run = factories.one_time_job(task="tests.sleep", args=[120])
    retrying = factories.one_time_job(
        task="tests.fail", retry={"max_attempts": 3, "initial_delay_seconds": 3600, "jitter": False}
    )

    samples, executed_at = [], {}
    started = time.monotonic()
    while time.monotonic() - started < 40:
        samples.append(
            (Run.objects.count(), Attempt.objects.count(), OutboxMessage.objects.count())
        )
        executed_at[round(time.monotonic() - started)] = sum(
            event["event"] == "executed" for event in stack.executions()
        )
        time.sleep(0.5)
    stack.kill("worker")  # the long run would hold a graceful stop for its whole sleep

    runs, attempts, outbox = (max(column) for column in zip(*samples, strict=True))
    executed = executed_at[max(executed_at)]
    report_figure(f"{executed} runs executed in 40 s with a 3 s retention: at most {runs} "
                  f"runs, {attempts} attempts, {outbox} outbox rows at once")  # fmt: skip
    # About 5 a second for 40 s, of which at most retention + pruning interval + the
    # pipeline's lag of each job's runs, and the two kept runs, are ever in the table.
    assert executed >= 100, executed_at
    # Runs kept succeeding in the last ten seconds, not only before the tables filled.
    assert executed - executed_at[max(executed_at) - 10] >= 20, executed_at
    assert runs <= 60 and attempts <= 60 and outbox <= 60, samples
    assert runs * 3 <= executed
    # Nothing unfinished went: the long run (running) and the retry an hour away, each
    # with its attempt, though both began well over the retention ago.
    long = Run.objects.get(job=long_run)
    assert long.state == RunState.RUNNING and long.attempts.count() == 1
    waiting = Run.objects.get(job=retrying)
    assert waiting.state == RunState.RETRY_WAIT
    assert list(waiting.attempts.values_list("state", flat=True)) == [AttemptState.FAILED]


@pytest.mark.django_db
def test_pruned_failed_runs_stay_counted_and_the_jobs_own_history_stays(user, operator_api):
    """scheduler_dead_letter_total is a counter: pruning a failed run never lowers it. An
    operator's trigger (`job.triggered`, which names the run it made) is the job's history:
    it stays, without the run."""
    from tests.jobs.test_metrics import scrape

    def dead_letters() -> float:
        text = operator_api.get("/metrics").content.decode()
        return scrape(text)[("scheduler_dead_letter_total", ())]

    job = make_job(user, now=NOW - 60 * DAY)
    runs = finished_runs(job, user, NOW - 40 * DAY, NOW - 39 * DAY)  # both failed, then kept 1
    Job.objects.filter(id=job.id).update(state=JobState.COMPLETED)
    before = dead_letters()
    triggered = AuditEvent.objects.filter(action="job.triggered", job_id=job.id)
    assert triggered.count() == 2

    assert pruner_run_once(now=NOW, config=KEEP_30_DAYS).runs_pruned == 2

    assert not Run.objects.filter(id__in=[run.id for run in runs]).exists()
    assert dead_letters() == before == 2
    assert list(triggered.values_list("run_id", flat=True)) == [None, None]


@pytest.mark.django_db
def test_a_backfill_repeated_after_retention_runs_no_occurrence_twice(user):
    """A backfill remembers what it ran past retention: the same range backfilled again
    once the pruner has deleted its runs (a retention of a minute, as a fraction of a day)
    creates nothing, and a wider range creates only the occurrences not run before."""
    hourly = {"kind": "cron", "expression": "0 * * * *", "timezone": "UTC"}
    job = make_job(user, now=NOW - 60 * DAY, schedule=hourly)
    day = backfill_occurrences(job=job, start=NOW - 50 * DAY, end=NOW - 49 * DAY)
    first = job_backfill(job=job, instants=day, actor=user, now=NOW)
    assert len(first.created) == 24
    Run.objects.filter(job=job).update(state=RunState.SUCCEEDED, finished_at=NOW)
    finished_runs(job, user, NOW + dt.timedelta(minutes=2), state=RunState.SUCCEEDED)  # kept

    later = NOW + dt.timedelta(hours=1)
    pruned = pruner_run_once(now=later, config=PrunerConfig(run_retention_days=1 / 24 / 60))
    assert pruned.runs_pruned == 24
    assert not Run.objects.filter(job=job, kind=RunKind.BACKFILL).exists()

    again = job_backfill(job=job, instants=day, actor=user, now=later)
    assert again.created == []  # every occurrence of the day ran once already
    assert (again.existing, again.pruned) == ([], day)
    wider = backfill_occurrences(job=job, start=NOW - 50 * DAY, end=NOW - 48 * DAY)
    more = job_backfill(job=job, instants=wider, actor=user, now=later)
    assert [run.scheduled_for for run in more.created] == wider[24:]
    assert (more.existing, more.pruned) == ([], day)
    assert Run.objects.filter(job=job, kind=RunKind.BACKFILL).count() == 24
