"""The scheduler pass: one pass of the scheduler's own concerns, in order.

1. the materializer (dispatch.materializer): due occurrences -> runs, by the job's misfire,
   overlap, jitter and pause_after_failures policies;
2. the promoter (dispatch.promoter): due retries and due, free `pending` runs -> queued;
3. the dependencies step (dispatch.dependencies): ends of upstream runs -> dependent runs;
4. the completer (dispatch.completer): jobs whose schedule is over -> completed.

Each step is a bounded batch in its own transaction(s). `manage.py scheduler` loops this
pass, sleeping until the next due instant (`scheduler_sleep_seconds`, `SchedulerWake`: to
the millisecond, and woken by a NOTIFY when a job's next fire becomes earlier); beside it,
in loops of their own, run the reaper, the reconciler and the pruner (idempotency keys, run
logs).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import time

from django.db import DatabaseError
from django.db.models import Min

from jobs.clock import db_now
from jobs.dependencies import dependencies_next_due
from jobs.models import Job, JobState, Run, RunState
from jobs.notify import notified_instant
from jobs.partitions import PartitionScope, in_partitions, partitions_held

from .completer import CompleterConfig, CompleterResult, CompleterWindow, completer_run_once
from .config import config_require
from .dependencies import DependenciesConfig, dependencies_run_once
from .materializer import MaterializerConfig, materializer_run_once
from .promoter import PromoterConfig, promoter_run_once
from .wakeup import Listener

log = logging.getLogger("dispatch.scheduler")
# A pass slower than this is logged with the time of each of its steps.
SLOW_PASS_SECONDS = 1.0
# How long a pass that left due work to another replica waits before it looks again.
HELD_ELSEWHERE_SECONDS = 0.02


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    batch_size: int = 500  # due jobs (and due retries) claimed per transaction
    poll_interval: float = 1.0  # longest sleep: picks up jobs created while sleeping
    # Only the due work of the partitions this replica holds (dispatch.partitions); None:
    # all of it (tests of one replica).
    scope: PartitionScope | None = None

    def __post_init__(self) -> None:
        config_require(self, at_least_one=("batch_size",), positive=("poll_interval",))


@dataclasses.dataclass(frozen=True)
class SchedulerResult:
    runs_created: int  # runs that will execute (queued, or pending on jitter or overlap)
    retries_queued: int
    batch_full: bool  # more due work is probably waiting: loop again at once
    runs_skipped: int = 0  # occurrences recorded `skipped` (misfire, overlap)
    runs_released: int = 0  # pending runs queued because they became due and free
    jobs_completed: int = 0
    jobs_paused: int = 0  # by pause_after_failures
    dependent_runs_created: int = 0  # by the ends of their upstream runs
    dependent_runs_skipped: int = 0


def scheduler_run_once(
    *, now: dt.datetime, config: SchedulerConfig, completer_window: CompleterWindow | None = None
) -> SchedulerResult:
    """One pass; `completer_window`: where the completer's walk is, kept by the loop (None:
    a walk from the first job awaiting completion)."""
    marks = [time.monotonic()]  # when each step ended, after when the pass began
    materialized = materializer_run_once(
        now=now, config=MaterializerConfig(batch_size=config.batch_size, scope=config.scope)
    )
    marks.append(time.monotonic())
    promoted = promoter_run_once(
        now=now, config=PromoterConfig(batch_size=config.batch_size, scope=config.scope)
    )
    marks.append(time.monotonic())
    dependents = dependencies_run_once(
        now=now, config=DependenciesConfig(batch_size=config.batch_size)
    )
    marks.append(time.monotonic())
    # Completion can wait for a backlog of due work: it is the safety net behind the
    # trigger that completes a job with its last run (a bounded window of the jobs awaiting
    # completion), and no run starts sooner for it.
    backlog = materialized.batch_full or promoted.batch_full or dependents.batch_full
    completed = (
        CompleterResult()
        if backlog
        else completer_run_once(
            now=now,
            config=CompleterConfig(batch_size=config.batch_size),
            window=completer_window if completer_window is not None else CompleterWindow(),
        )
    )
    marks.append(time.monotonic())
    if marks[-1] - marks[0] > SLOW_PASS_SECONDS:
        steps = zip(
            ("materializer", "promoter", "dependencies", "completer"),
            marks,
            marks[1:],
            strict=False,
        )
        log.warning(
            "slow scheduler pass (%s): %d runs created",
            ", ".join(f"{name} {end - start:.2f}s" for name, start, end in steps),
            materialized.runs_created,
        )
    return SchedulerResult(
        runs_created=materialized.runs_created,
        retries_queued=promoted.retries_queued,
        batch_full=backlog or completed.batch_full,
        runs_skipped=materialized.runs_skipped,
        runs_released=promoted.runs_released,
        jobs_completed=completed.jobs_completed,
        jobs_paused=materialized.jobs_paused,
        dependent_runs_created=dependents.runs_created,
        dependent_runs_skipped=dependents.runs_skipped,
    )


def scheduler_next_due(
    *, now: dt.datetime, scope: PartitionScope | None = None
) -> dt.datetime | None:
    """The earliest instant at which there will be work (the queries use partial indexes).
    Pending runs count only while their jitter is still ahead: a buffered run waits for
    its job's active run, which the poll interval notices. With a scope, only the work of
    the partitions held now (others' due work would make the loop spin): each query walks
    its index in order until a row of one of them, and none is made while none is held."""
    jobs, runs = Job.objects.filter(state=JobState.ACTIVE), Run.objects.all()
    if scope is not None:
        held = partitions_held(scope)
        if not held:
            return None
        jobs = jobs.filter(in_partitions(held, scope))
        runs = runs.filter(in_partitions(held, scope, job_id="job_id"))
    job_due = jobs.aggregate(at=Min("next_run_at"))["at"]
    retry_due = runs.filter(state=RunState.RETRY_WAIT).aggregate(at=Min("next_attempt_at"))["at"]
    jitter_due = runs.filter(state=RunState.PENDING, due_at__gt=now).aggregate(at=Min("due_at"))[
        "at"
    ]
    dependents_due = dependencies_next_due(now=now)
    candidates = [at for at in (job_due, retry_due, jitter_due, dependents_due) if at is not None]
    return min(candidates) if candidates else None


def scheduler_sleep_seconds(
    *, now: dt.datetime, config: SchedulerConfig, pass_started_at: dt.datetime | None = None
) -> float:
    """Sleep until the next due instant, never longer than the poll interval.

    Work already due when the pass began (`pass_started_at`) that the pass left is held by
    another replica (SKIP LOCKED): wait HELD_ELSEWHERE_SECONDS for it rather than spin."""
    next_due = scheduler_next_due(now=now, scope=config.scope)
    if next_due is None:
        return config.poll_interval
    seconds = (next_due - now).total_seconds()
    if pass_started_at is not None and next_due <= pass_started_at:
        seconds = max(seconds, HELD_ELSEWHERE_SECONDS)
    return min(config.poll_interval, max(0.0, seconds))


class SchedulerWake:
    """How `manage.py scheduler` sleeps between passes: until the next due instant exactly
    (the loop's jitter spreads only a sleep of the whole poll interval, so it never delays
    an occurrence), ending early on a NOTIFY on CHANNEL_SCHEDULE (a job created, resumed or
    rescheduled). A notification makes it look again at when work is next due (three index
    lookups) and sleep on until then, so a job created due later costs no pass."""

    def __init__(self, config: SchedulerConfig, listener: Listener) -> None:
        self.config = config
        self.listener = listener
        self._pass_started_at: dt.datetime | None = None
        self._until: float | None = None  # time.monotonic() of the next due instant
        # (the database's clock, time.monotonic()) read together at the latest look.
        self._anchor: tuple[dt.datetime, float] | None = None
        self.completer_window = CompleterWindow()  # the completer's walk, pass after pass

    def run_once(self, *, now: dt.datetime, config: SchedulerConfig) -> SchedulerResult:
        self._pass_started_at = now
        return scheduler_run_once(now=now, config=config, completer_window=self.completer_window)

    def _next_wake(self, pass_started_at: dt.datetime | None = None) -> tuple[float, float]:
        """(seconds until the next due instant, the time.monotonic() they count from): read
        with the database's clock, before the queries that find the instant."""
        now = db_now()
        counted_from = time.monotonic()
        self._anchor = (now, counted_from)
        seconds = scheduler_sleep_seconds(
            now=now, config=self.config, pass_started_at=pass_started_at
        )
        return seconds, counted_from

    def sleep_seconds(self, _result: SchedulerResult | None = None) -> float:
        """The step's sleep after a pass (run_once_step's `sleep`)."""
        seconds, counted_from = self._next_wake(self._pass_started_at)
        # A sleep of the whole poll interval takes the loop's jitter; one until a due
        # instant does not (run_loop waits only for a sleep above 0).
        due_soon = 0 < seconds < self.config.poll_interval
        self._until = counted_from + seconds if due_soon else None
        return seconds

    def wait(self, seconds: float) -> None:
        """run_loop's wait: `seconds` is the step's sleep with the loop's jitter, or its
        back-off after a failed step."""
        until = self._until if self._until is not None else time.monotonic() + seconds
        self._until = None
        while (remaining := until - time.monotonic()) > 0:
            if not self.listener.wait(remaining) or self.listener.stop.is_set():
                return
            announced = self._announced(self.listener.payloads)
            if announced is not None:
                until = min(until, announced)  # no query: the notifications said when
                continue
            try:
                seconds, counted_from = self._next_wake()
            except DatabaseError:
                return  # the next pass meets the outage and backs off
            until = min(until, counted_from + seconds)

    def _announced(self, payloads: list[str]) -> float | None:
        """The time.monotonic() of the earliest instant these notifications announce, on
        the database's clock read at the latest look; None when one announces none (then
        the wait looks again at when work is next due)."""
        instants = [notified_instant(payload) for payload in payloads]
        if not instants or None in instants or self._anchor is None:
            return None
        db_at, counted_from = self._anchor
        return counted_from + (min(instants) - db_at).total_seconds()
