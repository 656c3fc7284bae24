"""Dependencies between jobs: a job whose schedule is of kind `after` runs when its upstream
jobs' runs end (docs/semantics.md, "Dependencies between jobs").

Everything that decides a dependent occurrence is here, in one place:
- the edges (`JobDependency`), rewritten with every version of a dependent job;
- `dependency_signals_apply`: the ends of upstream runs (signal rows written by the trigger
  of storage.dependencies in the transaction of each run's terminal transition) counted
  into a gate per (dependent job, instant, kind), and the gate decided once: the
  dependent's run with its outbox row, or a `skipped` run whose reason begins `upstream:`;
- `dependency_deadlines_apply`: gates whose `within_seconds` (or, without one,
  SCHEDULER_DEPENDENCY_WITHIN_SECONDS) passed, skipped;
- `dependency_held_release`: gates completed while their job was paused, decided by its
  misfire policy once it is active again.

Each gate changes only by a conditional update on its state, after which the run is
written, so a gate is decided exactly once whatever runs concurrently; the unique
constraints on runs are the backstop. The dependent job's row is locked (in id order) while
its gates change, so two upstreams ending together are counted one after the other.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import uuid

from django.conf import settings
from django.db import transaction
from django.db.models import F, Func, Value

from storage.dependencies import dependency_graph_lock

from . import keys
from .models import (
    DependencyGate,
    DependencySignal,
    GateState,
    Job,
    JobDependency,
    JobState,
    JobVersion,
    Run,
    RunState,
)
from .occurrences import JobCalendars, calendar_views_of, occurrence_decide
from .outbox import outbox_enqueue_runs
from .policies import misfire_plan
from .schedules import job_preview

log = logging.getLogger("jobs.dependencies")

AFTER = "after"
# A dependent job names at most this many upstream jobs (a wider fan-in: a job in between).
MAX_UPSTREAMS = 20
# How far `GET /jobs/{id}/graph/` walks up and down from a job, and how many jobs it lists.
GRAPH_MAX_DEPTH = 10
GRAPH_MAX_JOBS = 500
# `on` -> the upstream run states that count as arrived; any other terminal state decides a
# skip (cancelled and skipped upstream runs never trigger a run).
ON_STATES = {
    "succeeded": frozenset({RunState.SUCCEEDED}),
    "failed": frozenset({RunState.FAILED}),
    "finished": frozenset({RunState.SUCCEEDED, RunState.FAILED}),
}
DEFAULT_ON = "succeeded"


def within_seconds_of(schedule: dict) -> float:
    """How long a fan-in waits after its first upstream arrived: the schedule's
    `within_seconds`, else SCHEDULER_DEPENDENCY_WITHIN_SECONDS (every gate has a deadline,
    so every occurrence is decided within a bound and waiting gates stay bounded in number)."""
    return schedule.get("within_seconds") or settings.SCHEDULER_DEPENDENCY_WITHIN_SECONDS


class DependencyCycle(ValueError):
    """The edges asked for would close a cycle."""


def is_dependent(spec: dict) -> bool:
    return spec["schedule"]["kind"] == AFTER


def dependency_upstream_ids(spec: dict) -> list[uuid.UUID]:
    """The upstream job ids a spec names (none for a time-based schedule)."""
    if not is_dependent(spec):
        return []
    return [uuid.UUID(str(job_id)) for job_id in spec["schedule"]["jobs"]]


# -- the graph ----------------------------------------------------------------------------


def dependency_reaches(*, start: list[uuid.UUID], target: uuid.UUID) -> bool:
    """Whether `target` is `start` or one of their upstreams, transitively: one query per
    level of the graph (acyclic by construction, so the walk ends)."""
    seen: set[uuid.UUID] = set()
    frontier = set(start)
    while frontier:
        if target in frontier:
            return True
        seen |= frontier
        frontier = (
            set(
                JobDependency.objects.filter(dependent_id__in=frontier).values_list(
                    "upstream_id", flat=True
                )
            )
            - seen
        )
    return False


def dependency_edges_write(*, job_id: uuid.UUID, spec: dict, check_cycle: bool = True) -> None:
    """Rewrite the job's edges for its new spec, in the caller's transaction, under the
    graph's advisory lock (storage.dependencies): with the lock held the cycle check sees
    every committed edge, so two concurrent edits cannot close a cycle between them.
    DependencyCycle when they would (the caller's transaction is then rolled back)."""
    upstreams = dependency_upstream_ids(spec)
    existing = JobDependency.objects.filter(dependent_id=job_id)
    if not upstreams and not existing.exists():
        return
    dependency_graph_lock()
    if check_cycle and upstreams and dependency_reaches(start=upstreams, target=job_id):
        raise DependencyCycle(str(job_id))
    existing.delete()
    JobDependency.objects.bulk_create(
        [JobDependency(dependent_id=job_id, upstream_id=upstream) for upstream in upstreams]
    )


@dataclasses.dataclass(frozen=True)
class GraphNode:
    id: uuid.UUID
    name: str
    state: str
    depth: int  # edges from the job asked about


def dependency_graph(
    *, job: Job, visible, max_depth: int = GRAPH_MAX_DEPTH
) -> dict[str, list[GraphNode]]:
    """The job's upstream and downstream jobs, transitively up to `max_depth` edges and
    GRAPH_MAX_JOBS jobs each way; `visible` is a queryset of the jobs the caller may see
    (others are neither listed nor walked through)."""
    walks = {
        "upstream": ("dependent_id", "upstream_id"),
        "downstream": ("upstream_id", "dependent_id"),
    }
    graph = {}
    for direction, (here, there) in walks.items():
        found: dict[uuid.UUID, int] = {}
        frontier = {job.id}
        for depth in range(1, max_depth + 1):
            if not frontier or len(found) >= GRAPH_MAX_JOBS:
                break
            ids = (
                set(
                    JobDependency.objects.filter(**{f"{here}__in": frontier}).values_list(
                        there, flat=True
                    )
                )
                - set(found)
                - {job.id}
            )
            ids = set(visible.filter(id__in=ids).values_list("id", flat=True))
            for job_id in ids:
                found[job_id] = depth
            frontier = ids
        rows = visible.filter(id__in=list(found)[:GRAPH_MAX_JOBS]).values_list(
            "id", "name", "state"
        )
        graph[direction] = sorted(
            (GraphNode(id=i, name=n, state=s, depth=found[i]) for i, n, s in rows),
            key=lambda node: (node.depth, node.name, str(node.id)),
        )
    return graph


def dependency_preview(
    *, upstreams: list[Job], visible, after: dt.datetime, count: int, depth: int = 0
) -> list[dt.datetime]:
    """The next `count` instants after `after` at which a job running after `upstreams`
    would have an occurrence: those every upstream has (an instant travels down a chain;
    a fan-in needs them all), each upstream's by its own schedule, an `after` upstream's
    by its own upstreams (up to GRAPH_MAX_DEPTH, through `visible` jobs only). Whether
    the occurrence runs is decided by how the upstream runs end, at their ends."""
    common: set[dt.datetime] | None = None
    for upstream in upstreams:
        if is_dependent(upstream.spec):
            if depth >= GRAPH_MAX_DEPTH:
                return []
            above = list(visible.filter(id__in=dependency_upstream_ids(upstream.spec)))
            instants = dependency_preview(upstreams=above, visible=visible, after=after,
                                          count=count * 10, depth=depth + 1)  # fmt: skip
        else:
            instants = [
                fire["at"] for fire in job_preview(job=upstream, after=after, count=count * 10)
            ]
        common = set(instants) if common is None else common & set(instants)
    return sorted(common or ())[:count]


# -- deciding dependent occurrences --------------------------------------------------------


@dataclasses.dataclass
class Decisions:
    """What one batch decided: its counts, the runs it queued (their outbox rows are
    written in one statement at the batch's end: `decisions_enqueue`) and the dependent
    jobs' current versions, read once per job."""

    signals: int = 0
    runs_created: int = 0
    runs_skipped: int = 0
    held: int = 0  # complete while their job was paused
    queued: list = dataclasses.field(default_factory=list)
    versions: dict = dataclasses.field(default_factory=dict)

    def add(self, outcome: str) -> None:
        if outcome == "created":
            self.runs_created += 1
        elif outcome == "skipped":
            self.runs_skipped += 1
        elif outcome == "held":
            self.held += 1

    def version_of(self, job: Job) -> JobVersion:
        if job.id not in self.versions:
            self.versions[job.id] = JobVersion.objects.get(job=job, version=job.version)
        return self.versions[job.id]


def decisions_enqueue(*, decisions: Decisions, now: dt.datetime) -> None:
    """The outbox rows of the runs the batch queued, in one statement (jobs.outbox)."""
    outbox_enqueue_runs(runs=decisions.queued, now=now)


def _lock_dependents(job_ids) -> dict[uuid.UUID, Job]:
    """The dependent jobs' rows (not deleted), locked FOR NO KEY UPDATE in id order until
    the caller's transaction ends: their gates change one transaction at a time."""
    jobs = (
        Job.objects.select_for_update(no_key=True)
        .filter(id__in=list(job_ids), deleted_at=None)
        .order_by("id")
    )
    return {job.id: job for job in jobs}


# A signal whose application raised waits this long before it is tried again (its
# `created_at` moved ahead), so that it neither blocks the others nor makes the scheduler spin.
SIGNAL_RETRY = dt.timedelta(seconds=30)


def dependency_signals_apply(*, now: dt.datetime, limit: int) -> Decisions:
    """Consume up to `limit` signals due by `now` (oldest first, FOR UPDATE SKIP LOCKED:
    replicas share them) and apply each to the gates of its job's dependents; the signals
    are deleted in the caller's transaction, with the runs they made. A signal whose
    application fails is logged and left for SIGNAL_RETRY, and the others go on."""
    decisions = Decisions()
    signals = list(
        DependencySignal.objects.select_for_update(skip_locked=True)
        .filter(created_at__lte=now)
        .order_by("id")[:limit]
    )
    if not signals:
        return decisions
    edges: dict[uuid.UUID, list[uuid.UUID]] = {}
    for upstream, dependent in JobDependency.objects.filter(
        upstream_id__in={s.job_id for s in signals}
    ).values_list("upstream_id", "dependent_id"):
        edges.setdefault(upstream, []).append(dependent)
    dependents = _lock_dependents({d for ds in edges.values() for d in ds})
    done, failed = [], []
    for signal in signals:
        queued = len(decisions.queued)
        try:
            with transaction.atomic():
                for dependent_id in edges.get(signal.job_id, ()):
                    job = dependents.get(dependent_id)
                    if job is not None:
                        decisions.add(
                            dependent_occurrence_arrive(
                                job=job, signal=signal, now=now, decisions=decisions
                            )
                        )
        except Exception:  # noqa: BLE001 - one bad signal must not stop the others
            log.exception("dependency signal %s could not be applied", signal.id)
            del decisions.queued[queued:]  # rolled back with the signal's savepoint
            failed.append(signal.id)
            continue
        done.append(signal.id)
    DependencySignal.objects.filter(id__in=done).delete()
    if failed:
        DependencySignal.objects.filter(id__in=failed).update(created_at=now + SIGNAL_RETRY)
    decisions_enqueue(decisions=decisions, now=now)
    decisions.signals = len(done)
    return decisions


def _gate(*, job: Job, scheduled_for: dt.datetime, kind: str, now: dt.datetime) -> DependencyGate:
    """The gate of (job, instant, kind), created (INSERT ... ON CONFLICT DO NOTHING)
    counting every upstream of the job's spec."""
    DependencyGate.objects.bulk_create(
        [DependencyGate(job=job, scheduled_for=scheduled_for, kind=kind,
                        missing=len(job.spec["schedule"]["jobs"]), created_at=now)],
        ignore_conflicts=True,
    )  # fmt: skip
    return DependencyGate.objects.get(job=job, scheduled_for=scheduled_for, kind=kind)


def _array_append(field: str, value) -> Func:
    return Func(F(field), Value(value), function="array_append")


def dependent_occurrence_arrive(
    *, job: Job, signal: DependencySignal, now: dt.datetime, decisions: Decisions
) -> str:
    """Count one upstream run's end into the dependent's gate for that run's instant and
    kind, and decide the gate when this settles it. The job's row is locked by the caller.
    Returns "created", "skipped", "held" (its job is paused), "waiting" or "ignored" (a
    cancelled or completed job, an upstream no longer named, a gate already decided, an
    upstream already counted)."""
    schedule = job.spec["schedule"]
    if job.state not in (JobState.ACTIVE, JobState.PAUSED) or not is_dependent(job.spec):
        return "ignored"
    if str(signal.job_id) not in {str(j) for j in schedule["jobs"]}:
        return "ignored"
    gate = _gate(job=job, scheduled_for=signal.scheduled_for, kind=signal.kind, now=now)
    if gate.state != GateState.WAITING or signal.job_id in gate.arrived_jobs:
        return "ignored"
    on = schedule.get("on", DEFAULT_ON)
    matches = signal.state in ON_STATES[on]
    missing = gate.missing - 1
    reason = ""
    if not matches:
        reason = (
            f"upstream: job {signal.job_id} run {signal.run_id} ended {signal.state}"
            f" (this job runs on {on})"
        )
        state = GateState.DECIDED
    elif missing > 0:
        state = GateState.WAITING
    else:
        state = GateState.HELD if job.state == JobState.PAUSED else GateState.DECIDED
    deadline = gate.deadline_at
    if deadline is None and state == GateState.WAITING:
        deadline = now + dt.timedelta(seconds=within_seconds_of(schedule))
    # The run's id goes in with the decision (the foreign key is checked at commit).
    run_id = uuid.uuid4() if state == GateState.DECIDED else None
    won = DependencyGate.objects.filter(
        id=gate.id, state=GateState.WAITING, missing=gate.missing
    ).update(
        state=state,
        missing=missing,
        arrived_jobs=_array_append("arrived_jobs", signal.job_id),
        arrived_runs=_array_append("arrived_runs", signal.run_id),
        deadline_at=deadline,
        ready_at=now if state != GateState.WAITING else None,
        run_id=run_id,
    )
    if not won:
        return "ignored"
    if state == GateState.WAITING:
        return "waiting"
    if state == GateState.HELD:
        return "held"
    return _decide(job=job, gate=gate, run_id=run_id, skip_reason=reason, now=now,
                   decisions=decisions)  # fmt: skip


def _decide(
    *,
    job: Job,
    gate: DependencyGate,
    run_id: uuid.UUID,
    skip_reason: str,
    now: dt.datetime,
    decisions: Decisions,
) -> str:
    """Write the run of a gate just decided (by a won conditional update that set its
    `run_id`): queued (its outbox row follows with the batch's, `decisions_enqueue`), or
    `skipped` with its reason (whose insert signals its own dependents: skips propagate).
    An occurrence that has its run already is a unique violation: the caller's savepoint
    rolls the decision back, and the signal is tried again, then ignored."""
    # The one decision of an occurrence (jobs.occurrences): the dependent's own pause and
    # calendars come before its upstream's reason, as for a time-based occurrence.
    calendars = (
        JobCalendars.of(job.spec, calendar_views_of(job.spec))
        if job.spec.get("calendars")
        else JobCalendars()
    )
    skip_reason = occurrence_decide(
        at=gate.scheduled_for, calendars=calendars, upstream=skip_reason
    ).skip_reason
    skipped = bool(skip_reason)
    run = Run(
        id=run_id,
        job=job,
        job_version=decisions.version_of(job),
        kind=gate.kind,
        state=RunState.SKIPPED if skipped else RunState.QUEUED,
        scheduled_for=gate.scheduled_for,
        due_at=now,
        created_at=now,
        finished_at=now if skipped else None,
        skip_reason=skip_reason[:200],
        idempotency_key=keys.dependent_key(job.id, gate.kind, gate.scheduled_for),
    )
    run.save(force_insert=True)
    if skipped:
        return "skipped"
    decisions.queued.append(run)
    return "created"


def _decide_gate(
    *, gate: DependencyGate, job: Job, from_state: str, skip_reason: str, now: dt.datetime,
    decisions: Decisions,
) -> None:  # fmt: skip
    """Decide a waiting or held gate (deadline, resume) by a conditional update, then its run."""
    run_id = uuid.uuid4()
    if DependencyGate.objects.filter(id=gate.id, state=from_state).update(
        state=GateState.DECIDED, ready_at=gate.ready_at or now, run_id=run_id
    ):
        decisions.add(
            _decide(job=job, gate=gate, run_id=run_id, skip_reason=skip_reason, now=now,
                    decisions=decisions)
        )  # fmt: skip


def dependency_deadlines_apply(*, now: dt.datetime, limit: int) -> Decisions:
    """Skip up to `limit` waiting gates whose deadline (`within_seconds`, or the default
    bound) has passed, through
    dependency_gate_deadline_idx (FOR UPDATE SKIP LOCKED), never reading runs. The reason
    names the first upstream run that arrived and the jobs still missing."""
    decisions = Decisions()
    gates = list(
        DependencyGate.objects.select_for_update(skip_locked=True)
        .filter(state=GateState.WAITING, deadline_at__isnull=False, deadline_at__lte=now)
        .select_related("job")
        .order_by("deadline_at")[:limit]
    )
    for gate in gates:
        job = gate.job
        if job.state not in (JobState.ACTIVE, JobState.PAUSED) or job.deleted_at is not None:
            # Gone: decided without a run, so the deadline index forgets it.
            DependencyGate.objects.filter(id=gate.id, state=GateState.WAITING).update(
                state=GateState.DECIDED, ready_at=now
            )
            continue
        arrived = {str(j) for j in gate.arrived_jobs}
        absent = [str(j) for j in job.spec["schedule"].get("jobs", ()) if str(j) not in arrived]
        first_job = gate.arrived_jobs[0] if gate.arrived_jobs else None
        first_run = gate.arrived_runs[0] if gate.arrived_runs else None
        within = job.spec["schedule"].get("within_seconds")
        bound = (
            f"{within}s (within_seconds)"
            if within
            else f"{_seconds(gate.deadline_at - gate.created_at)}s (the default bound)"
        )
        reason = (
            f"upstream: job {first_job} run {first_run} waited {bound} for"
            f" {', '.join(absent) or 'the others'}"
        )
        _decide_gate(gate=gate, job=job, from_state=GateState.WAITING, skip_reason=reason,
                     now=now, decisions=decisions)  # fmt: skip
    return decisions


def _seconds(delta: dt.timedelta) -> str:
    """A bound as written in a reason: whole seconds unless it has a fraction."""
    seconds = round(delta.total_seconds(), 3)
    return str(int(seconds)) if seconds == int(seconds) else str(seconds)


def dependency_held_release(*, now: dt.datetime, limit: int) -> Decisions:
    """Decide up to `limit` held gates of jobs active again (through
    dependency_gate_held_idx): by the job's misfire policy, counted from when each gate's
    last upstream arrived, as the occurrences a time-based job missed while paused are."""
    decisions = Decisions()
    job_ids = set(
        DependencyGate.objects.filter(state=GateState.HELD, job__state=JobState.ACTIVE)
        .values_list("job_id", flat=True)
        .order_by()
        .distinct()[:limit]
    )
    for job in _lock_dependents(job_ids).values():
        if job.state != JobState.ACTIVE:
            continue
        gates = list(
            DependencyGate.objects.filter(job=job, state=GateState.HELD).order_by("ready_at", "id")[
                :limit
            ]
        )
        # A gate per ready instant: misfire_plan keys its decisions by the instants given.
        due = [gate.ready_at + dt.timedelta(microseconds=index) for index, gate in enumerate(gates)]
        skips = misfire_plan(
            spec=job.spec, created_at=job.created_at, due=due, next_at=None, now=now
        )
        for gate, at in zip(gates, due, strict=True):
            _decide_gate(gate=gate, job=job, from_state=GateState.HELD,
                         skip_reason=skips.get(at, ""), now=now, decisions=decisions)  # fmt: skip
    decisions_enqueue(decisions=decisions, now=now)
    return decisions


def dependency_upstream_runs(*, run: Run) -> list[uuid.UUID]:
    """The upstream runs whose ends decided this run (its gate's `arrived_runs`), in their
    order of arrival; none for a run not made by a gate. Reads the prefetched
    `dependency_gates` when the run has them (jobs.selectors.run_list), else one probe of
    the gate's `run` index."""
    gates = run.dependency_gates.all()
    return [run_id for gate in gates for run_id in gate.arrived_runs]


def dependencies_next_due(*, now: dt.datetime) -> dt.datetime | None:
    """When the dependencies step next has work: the oldest signal's instant (a signal
    already there when a pass began was left by it, held by another replica or set back
    after a failure: the scheduler then waits rather than spin), now while a held gate of
    an active job waits, else the earliest gate deadline; None: nothing."""
    candidates = [
        DependencySignal.objects.order_by("created_at")
        .values_list("created_at", flat=True)
        .first(),
        DependencyGate.objects.filter(state=GateState.WAITING, deadline_at__isnull=False)
        .order_by("deadline_at")
        .values_list("deadline_at", flat=True)
        .first(),
    ]
    if DependencyGate.objects.filter(state=GateState.HELD, job__state=JobState.ACTIVE).exists():
        candidates.append(now)
    found = [at for at in candidates if at is not None]
    return min(found) if found else None
