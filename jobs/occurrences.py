"""The decision of one occurrence, and the explanation of a job's occurrences.

`occurrence_decide` is the one function that decides whether an occurrence of a job runs
and, if not, why: the scheduler (dispatch.materializer) calls it when it makes an
occurrence a run, and the predictions (`GET /jobs/{id}/occurrences/`, `POST
/schedules/preview/` with calendars) call it for the occurrences still to come, so a
prediction and the decision made later cannot disagree. Causes, in order of precedence:

- `paused:` the job was paused when it fell due (decided on resume by its misfire policy);
- `calendar:` an `exclude` calendar holds its instant, or no `only` calendar does
  (the instant is the one the job's `dst` policy resolved: DST first, calendar second);
- `upstream:` (a dependency's decision: jobs.dependencies passes it for schedules of kind `after`);
- `misfire:` later than the grace, and the misfire policy does not run it;
- `overlap:` a run of the job is still active, and the overlap policy skips it;
- `queue:` a paused queue holds its run back (a note, not a skip: it runs on resume).
`dst:` is never a reason to skip by itself here: a moved occurrence runs, and says so.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import functools
from collections.abc import Callable, Iterator

from .calendar_services import calendar_views, job_calendar_ids
from .calendars import CalendarView, calendars_skip_reason
from .models import JobState, Run, RunKind
from .policies import misfire_plan, overlap_decision
from .queues import queue_note
from .schedules import DEFAULT_DST, Occurrence, ScheduleError, gap_skipped, occurrences, zone
from .transitions import ACTIVE_RUN_STATES

UTC = dt.UTC
# Entries one page of the occurrences endpoint (and one preview) evaluates at most.
OCCURRENCES_PAGE_MAX = 500
PAUSED_SKIP = "paused: missed while the job was paused (misfire policy {policy})"
PAUSED_LATE = "paused: runs when the job is resumed (misfire policy {policy})"


@dataclasses.dataclass(frozen=True)
class JobCalendars:
    """The calendars a job names, as read for one decision (deleted ones left out)."""

    exclude: tuple[CalendarView, ...] = ()
    only: tuple[CalendarView, ...] = ()

    @classmethod
    def of(cls, spec: dict, views: dict[str, CalendarView]) -> JobCalendars:
        named = spec.get("calendars") or {}
        exclude, only = (
            tuple(views[i] for i in named.get(role) or () if i in views)
            for role in ("exclude", "only")
        )
        return cls(exclude=exclude, only=only)


@dataclasses.dataclass(frozen=True)
class Decision:
    skip_reason: str  # "" when the occurrence runs
    reasons: tuple[str, ...]  # every cause that bears on it, the skip reason first


def dst_reason(occurrence: Occurrence, dst: dict) -> str:
    if occurrence.dst == "gap_shifted":
        moved = occurrence.local.isoformat()
        return f"dst: a local time skipped by spring-forward, moved to {moved} (gap: shift)"
    if occurrence.dst == "fold_first":
        return "dst: the first of a repeated local time (fall back)"
    if occurrence.dst == "fold_second":
        return "dst: the second of a repeated local time (fall back, fold: both)"
    return ""


def occurrence_decide(
    *,
    at: dt.datetime,
    calendars: JobCalendars,
    dst: str = "",
    paused: str = "",
    upstream: str = "",
    misfire: str = "",
    overlap: Callable[[], str] | None = None,
    queue: str = "",
) -> Decision:
    """Whether the occurrence at `at` (UTC, already resolved by the job's DST policy) runs.

    The caller brings the facts: `paused` (a `paused:` reason when the job was paused at
    `at`), `misfire` (misfire_plan's reason for it), `upstream` (an `upstream:` reason,
    passed by jobs.dependencies for a dependent's occurrence), `queue` (a `queue:` note: held
    back, still runs) and `overlap`, called only when nothing else skips the occurrence
    (its policy acts on other runs: cancel_previous cancels them)."""
    skip = (
        paused
        or calendars_skip_reason(at=at, exclude=list(calendars.exclude), only=list(calendars.only))
        or upstream
        or misfire
    )
    if not skip and overlap is not None:
        skip = overlap()
    notes = tuple(note for note in (dst, queue) if note)
    return Decision(skip_reason=skip[:200], reasons=((skip[:200],) if skip else ()) + notes)


def job_paused_reason(*, spec: dict) -> tuple[str, bool]:
    """What a paused job's due occurrences will meet on resume: (reason, skipped)."""
    policy = (spec.get("misfire") or {}).get("policy", "run_all")
    if policy == "run_all":
        return PAUSED_LATE.format(policy=policy), False
    return PAUSED_SKIP.format(policy=policy), True


def spec_occurrences(
    *, spec: dict, after: dt.datetime, anchor: dt.datetime
) -> Iterator[Occurrence]:
    """The job spec's occurrences strictly after `after`, within start_at/end_at."""
    start_at, end_at = spec.get("start_at"), spec.get("end_at")
    if start_at:
        after = max(after, dt.datetime.fromisoformat(start_at) - dt.timedelta(microseconds=1))
    end = dt.datetime.fromisoformat(end_at) if end_at else None
    for occurrence in occurrences(
        spec["schedule"], after=after, dst=spec.get("dst") or DEFAULT_DST, anchor=anchor
    ):
        if end is not None and occurrence.at > end:
            return
        yield occurrence


def predicted_entry(
    *, occurrence: Occurrence, spec: dict, calendars: JobCalendars, paused: bool = False,
    overlap: Callable[[], str] | None = None, queue: str = "",
) -> dict:  # fmt: skip
    """One predicted occurrence as the explanation shows it (`will_run` / `will_skip`)."""
    paused_reason, paused_skips = job_paused_reason(spec=spec) if paused else ("", False)
    decision = occurrence_decide(
        at=occurrence.at,
        calendars=calendars,
        dst=dst_reason(occurrence, spec.get("dst") or DEFAULT_DST),
        paused=paused_reason if paused_skips else "",
        overlap=overlap,
        queue=queue,
    )
    reasons = decision.reasons
    if paused and not paused_skips:
        reasons = (paused_reason, *reasons)
    return {
        "scheduled_for": occurrence.at,
        "local": occurrence.local.isoformat(),
        "decision": "will_skip" if decision.skip_reason else "will_run",
        "run": None,
        "state": None,
        "reasons": list(reasons),
    }


def schedule_preview_with_calendars(
    *, schedule: dict, dst: dict, after: dt.datetime, count: int, anchor: dt.datetime,
    calendars: JobCalendars,
) -> list[dict]:  # fmt: skip
    """The next `count` occurrences after `after`, each flagged `excluded` with its
    `reason` when the calendars would skip it (the decision the scheduler makes)."""
    found = []
    spec = {"schedule": schedule, "dst": dst}
    for occurrence in spec_occurrences(spec=spec, after=after, anchor=anchor):
        decision = occurrence_decide(at=occurrence.at, calendars=calendars)
        found.append({"at": occurrence.at, "local": occurrence.local.isoformat(),
                      "dst": occurrence.dst, "excluded": bool(decision.skip_reason),
                      "reason": decision.skip_reason})  # fmt: skip
        if len(found) >= count:
            break
    return found


def cursor_encode(at: dt.datetime) -> str:
    return base64.urlsafe_b64encode(at.astimezone(UTC).isoformat().encode()).decode()


def cursor_decode(cursor: str) -> dt.datetime:
    """ValueError when it is not a cursor this module made."""
    try:
        at = dt.datetime.fromisoformat(base64.urlsafe_b64decode(cursor.encode()).decode())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError("not a cursor of this listing") from exc
    if at.tzinfo is None:
        raise ValueError("not a cursor of this listing")
    return at


def local_of(at: dt.datetime, spec: dict) -> str:
    schedule = spec["schedule"]
    tz = zone(schedule.get("timezone", "UTC")) if schedule["kind"] == "cron" else UTC
    return at.astimezone(tz).isoformat()


# -- the explanation of a job's occurrences (GET /jobs/{id}/occurrences/) ------------------
RUN_DECISIONS = {
    "skipped": "skipped",
    "running": "running",
    "pending": "waiting",
    "queued": "waiting",
    "retry_wait": "waiting",
}


def job_occurrences(
    *,
    job,
    start: dt.datetime,
    end: dt.datetime,
    cursor: dt.datetime | None,
    limit: int,
    now: dt.datetime,
) -> tuple[list[dict], dt.datetime | None]:
    """One page of the job's occurrences in [start, end), after `cursor` (exclusive) when
    given, in time order, and the cursor of the next page (None on the last one).

    The past comes from the job's scheduled runs (before its next_run_at: each occurrence
    there has its run), read through run_job_idx from the cursor on; the future is
    predicted from next_run_at by `occurrence_decide`. Either side evaluates at most
    `limit` + 1 entries, wherever the page lies in the window."""
    live = job.state in (JobState.ACTIVE, JobState.PAUSED) and job.deleted_at is None
    queue = queue_note(queue=job.spec.get("queue") or "", now=now) if live else ""
    boundary = job.next_run_at if live and job.next_run_at is not None else end
    runs = Run.objects.filter(job_id=job.id, kind=RunKind.SCHEDULED,
                              scheduled_for__lt=min(end, max(boundary, start)))  # fmt: skip
    runs = (
        runs.filter(scheduled_for__gt=cursor) if cursor else runs.filter(scheduled_for__gte=start)
    )
    entries = [
        {
            "scheduled_for": run.scheduled_for,
            "local": local_of(run.scheduled_for, job.spec),
            "decision": RUN_DECISIONS.get(run.state, "ran"),
            "run": run.id,
            "state": run.state,
            "reasons": [
                note
                for note in (
                    run.skip_reason,
                    _dst_note(job, run.scheduled_for),
                    queue if RUN_DECISIONS.get(run.state) == "waiting" else "",
                )
                if note
            ],
        }
        for run in runs.order_by("scheduled_for").only(
            "id", "scheduled_for", "state", "skip_reason"
        )[: limit + 1]
    ]
    if len(entries) <= limit and boundary < end:
        after = max(
            boundary - dt.timedelta(microseconds=1), cursor or start - dt.timedelta(microseconds=1)
        )
        views = calendar_views_of(job.spec)
        calendars = JobCalendars.of(job.spec, views)
        for occurrence in spec_occurrences(spec=job.spec, after=after, anchor=_anchor_of(job)):
            if occurrence.at >= end or len(entries) > limit:
                break
            overlap = None
            if occurrence.at == job.next_run_at:  # the runs active now meet the next one
                overlap = functools.partial(_predicted_overlap, job=job, at=occurrence.at)
            entry = predicted_entry(
                occurrence=occurrence,
                spec=job.spec,
                calendars=calendars,
                paused=job.state == JobState.PAUSED,
                overlap=overlap,
                queue=queue,
            )
            if (
                occurrence.at <= now
                and job.state == JobState.ACTIVE
                and entry["decision"] == "will_run"
            ):
                missed = misfire_plan(spec=job.spec, created_at=job.created_at,
                                      due=[occurrence.at], next_at=None, now=now)  # fmt: skip
                if missed:
                    entry["decision"], entry["reasons"] = "will_skip", [missed[occurrence.at]]
            entries.append(entry)
    page, more = entries[:limit], len(entries) > limit
    last = page[-1]["scheduled_for"] if more and page else None
    page = _with_gap_skips(page, job=job, lower=cursor or start,
                           upper=last or end - dt.timedelta(microseconds=1),
                           after_cursor=cursor is not None, now=now)  # fmt: skip
    return page, last


def _with_gap_skips(
    page: list[dict], *, job, lower: dt.datetime, upper: dt.datetime, after_cursor: bool,
    now: dt.datetime,
) -> list[dict]:  # fmt: skip
    """The page with an entry for each wall time a spring-forward removed under `gap:
    skip` in its span (at the transition instant, before an occurrence at the same one):
    the scheduler makes no run of it, and the explanation says why."""
    skips = gap_skipped(job.spec["schedule"], dst=job.spec.get("dst"),
                        after=lower - dt.timedelta(microseconds=1), until=upper)  # fmt: skip
    extra = [
        {"scheduled_for": at, "local": wall.isoformat(),
         "decision": "skipped" if at <= now else "will_skip", "run": None, "state": None,
         "reasons": [f"dst: {wall:%Y-%m-%d %H:%M} does not exist in "
                     f"{job.spec['schedule'].get('timezone', 'UTC')} (gap: skip)"]}
        for at, wall in skips
        # A page ends at its last entry (inclusive) and the next begins after it.
        if (lower < at if after_cursor else lower <= at) and at <= upper
    ]  # fmt: skip
    if not extra:
        return page
    return sorted(extra + page, key=lambda entry: entry["scheduled_for"])  # stable: skips first


def _dst_note(job, at: dt.datetime) -> str:
    """The `dst:` note of a past occurrence of a cron job (re-read from its schedule)."""
    if job.spec["schedule"]["kind"] != "cron":
        return ""
    dst = job.spec.get("dst") or DEFAULT_DST
    after = at - dt.timedelta(microseconds=1)
    try:
        for occurrence in occurrences(job.spec["schedule"], after=after, dst=dst):
            return dst_reason(occurrence, dst) if occurrence.at == at else ""
    except ScheduleError:  # a schedule that cannot be evaluated any more: no note
        pass
    return ""


def _predicted_overlap(*, job, at: dt.datetime) -> str:
    """The overlap skip the job's next occurrence meets if its active runs are still
    active then ("" for a policy that never skips)."""
    policy = job.spec.get("overlap", "allow")
    if policy not in ("skip", "buffer_one"):
        return ""
    active = Run.objects.filter(
        job_id=job.id, kind=RunKind.SCHEDULED, state__in=ACTIVE_RUN_STATES
    ).order_by("created_at", "id")
    return overlap_decision(policy=policy, active=list(active), scheduled_for=at).skip_reason


def calendar_views_of(spec: dict) -> dict[str, CalendarView]:
    return calendar_views(ids=[i for ids in job_calendar_ids(spec).values() for i in ids])


def _anchor_of(job) -> dt.datetime:
    start_at = job.spec.get("start_at")
    return dt.datetime.fromisoformat(start_at) if start_at else job.created_at
