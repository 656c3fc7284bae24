"""When a schedule fires: pure functions of the schedule, the DST policy and an instant;
and when a job fires: its schedule within its start_at and end_at.

Cron expressions are evaluated in local wall-clock time (croniter on naive datetimes) and
each wall time is mapped to instants by the job's DST policy, so croniter's own behaviour
at transitions is never the policy. See docs/time.md.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import zoneinfo
from collections.abc import Iterator
from functools import lru_cache
from typing import TYPE_CHECKING

from croniter import CroniterBadDateError, croniter

if TYPE_CHECKING:
    from .models import Job

UTC = dt.UTC
CRON_ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
GAP_POLICIES = ("shift", "skip")
FOLD_POLICIES = ("first", "both", "auto")
DEFAULT_DST = {"gap": "shift", "fold": "auto"}
# No zone has moved its clock by more than this at one transition.
_MAX_SHIFT = dt.timedelta(hours=3)
# Every valid 5-field expression matches within 28 years (a weekday on 29 February).
_LONGEST_DROUGHT = dt.timedelta(days=366 * 30)


class ScheduleError(ValueError):
    """A schedule that cannot be evaluated; the message names what is wrong."""


@dataclasses.dataclass(frozen=True)
class Occurrence:
    at: dt.datetime  # UTC
    local: dt.datetime  # aware, in the schedule's zone
    # "" | "gap_shifted" (moved to the end of a spring-forward gap) | "fold_first" |
    # "fold_second" (one of the two instants of a repeated local time)
    dst: str = ""


@lru_cache(maxsize=4096)
def normalize_cron(expression: str) -> str:
    """The expression in its 5-field form; ScheduleError if it is invalid or never fires."""
    expression = " ".join(expression.split())
    expression = CRON_ALIASES.get(expression.lower(), expression)
    if len(expression.split(" ")) != 5:
        raise ScheduleError("must have 5 fields: minute hour day-of-month month day-of-week")
    for field in expression.split(" "):
        for element in field.upper().split(","):
            if element == "R" or element.startswith(("R(", "H")):
                # croniter's random and hashed tokens change between evaluations, which
                # would give one daily job two runs in a day.
                raise ScheduleError(
                    f"'{element}': random (R) and hashed (H) values are not supported"
                )
    if not croniter.is_valid(expression):
        raise ScheduleError(f"'{expression}' is not a valid cron expression")
    try:
        croniter(expression, dt.datetime(2000, 1, 1)).get_next(dt.datetime)
    except CroniterBadDateError as exc:  # e.g. "0 0 31 2 *": February has no 31st
        raise ScheduleError(f"'{expression}' never fires") from exc
    return expression


@lru_cache(maxsize=1024)
def zone(name: str) -> zoneinfo.ZoneInfo:
    try:
        return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, TypeError) as exc:
        raise ScheduleError(f"'{name}' is not a known IANA time zone") from exc


def _hour_follows_elapsed_time(expression: str) -> bool:
    """cronie's rule for `fold: auto`: a wildcard or stepped hour fires in both hours."""
    hour = expression.split(" ")[1]
    return hour.startswith("*") or "/" in hour


def _wall_time_instants(
    wall: dt.datetime, tz: zoneinfo.ZoneInfo, *, gap: str, both_folds: bool
) -> list[Occurrence]:
    first = wall.replace(tzinfo=tz, fold=0)
    second = wall.replace(tzinfo=tz, fold=1)
    first_utc, second_utc = first.astimezone(UTC), second.astimezone(UTC)
    if first_utc == second_utc:
        return [Occurrence(first_utc, first)]
    if first_utc < second_utc:  # a repeated wall time (fall back)
        occurrences = [Occurrence(first_utc, first, "fold_first")]
        if both_folds:
            occurrences.append(Occurrence(second_utc, second, "fold_second"))
        return occurrences
    # A wall time that does not exist (spring forward): fold=1 reads it with the offset
    # after the gap, which lands before the transition; the transition itself is the
    # first real instant after the gap.
    if gap == "skip":
        return []
    transition = _transition_after(second_utc, tz)
    return [Occurrence(transition, transition.astimezone(tz), "gap_shifted")]


def wall_time_instant(wall: dt.datetime, tz: zoneinfo.ZoneInfo) -> dt.datetime:
    """The instant (UTC) of a naive wall time: the first of a repeated one, the end of the
    gap for one that does not exist."""
    first_utc = wall.replace(tzinfo=tz, fold=0).astimezone(UTC)
    second_utc = wall.replace(tzinfo=tz, fold=1).astimezone(UTC)
    if first_utc <= second_utc:
        return first_utc
    return _transition_after(second_utc, tz)


def _transition_after(instant: dt.datetime, tz: zoneinfo.ZoneInfo) -> dt.datetime:
    """The first instant after `instant` whose UTC offset differs (bisection, minute grain)."""
    low, high = instant, instant + _MAX_SHIFT
    offset = low.astimezone(tz).utcoffset()
    while high - low > dt.timedelta(seconds=1):
        middle = low + (high - low) / 2
        if middle.astimezone(tz).utcoffset() == offset:
            low = middle
        else:
            high = middle
    return high.replace(microsecond=0)


def _offset_range(instant: dt.datetime, tz: zoneinfo.ZoneInfo) -> tuple[dt.timedelta, dt.timedelta]:
    """The least and greatest UTC offsets of `tz` within a day of `instant`.

    Transitions are months apart, so the offsets a day before, at, and a day after cover
    every offset in between.
    """
    day = dt.timedelta(hours=26)
    offsets = [
        (instant + shift).astimezone(tz).utcoffset() for shift in (-day, dt.timedelta(0), day)
    ]
    return min(offsets), max(offsets)


def _cron_occurrences(
    expression: str, tz: zoneinfo.ZoneInfo, dst: dict, after: dt.datetime
) -> Iterator[Occurrence]:
    """Occurrences strictly after `after`, in increasing order, never twice one instant."""
    fold = dst.get("fold", DEFAULT_DST["fold"])
    both = fold == "both" or (fold == "auto" and _hour_follows_elapsed_time(expression))
    gap = dst.get("gap", DEFAULT_DST["gap"])
    # Start early enough in wall time: near a fall-back, the second instant of a repeated
    # wall time reads earlier on the clock than `after` does.
    low, high = _offset_range(after, tz)
    start_wall = after.astimezone(tz).replace(tzinfo=None) - (high - low)
    walls = croniter(expression, start_wall)
    pending: list[Occurrence] = []
    last_emitted: dt.datetime | None = None
    progress_wall = start_wall
    for _ in range(1_000_000):  # bounded; the drought check below ends a schedule that stalls
        wall = walls.get_next(dt.datetime)
        if wall - progress_wall > _LONGEST_DROUGHT:
            # e.g. "30 2 * 3 L0" in Europe/Berlin with gap=skip: every match is in a gap.
            raise ScheduleError("never fires under this DST policy")
        for occurrence in _wall_time_instants(wall, tz, gap=gap, both_folds=both):
            if occurrence.at > after:
                pending.append(occurrence)
        pending.sort(key=lambda occ: occ.at)
        # No later wall time can map to an instant before this one.
        horizon = wall.replace(tzinfo=UTC) - _offset_range(wall.replace(tzinfo=UTC), tz)[1]
        while pending and pending[0].at <= horizon:
            occurrence = pending.pop(0)
            if occurrence.at != last_emitted:
                last_emitted, progress_wall = occurrence.at, wall
                yield occurrence
    raise ScheduleError("the cron expression produced no occurrence")  # pragma: no cover


def occurrences(
    schedule: dict,
    *,
    after: dt.datetime,
    dst: dict | None = None,
    anchor: dt.datetime | None = None,
) -> Iterator[Occurrence]:
    """Every fire instant of `schedule` strictly after `after` (aware), in order.

    `anchor` is where an interval schedule counts from (the job's start_at or creation).
    Raises ScheduleError for a schedule that cannot be evaluated (e.g. past year 9999).
    """
    try:
        yield from _occurrences(schedule, after=after, dst=dst, anchor=anchor)
    except ScheduleError:
        raise
    except (ValueError, OverflowError) as exc:  # CroniterBadDateError is a ValueError
        raise ScheduleError(f"the schedule cannot be evaluated: {exc}") from exc


def _occurrences(
    schedule: dict,
    *,
    after: dt.datetime,
    dst: dict | None = None,
    anchor: dt.datetime | None = None,
) -> Iterator[Occurrence]:
    """The occurrences of `occurrences`, before its errors are translated."""
    kind = schedule["kind"]
    if kind == "after":  # fires on its upstreams' ends, never at a time (jobs.dependencies)
        return
    if kind == "once":
        run_at = schedule_run_at(schedule)
        if run_at > after:
            yield Occurrence(run_at, run_at)
        return
    if kind == "interval":
        every = dt.timedelta(seconds=schedule["every_seconds"])
        if anchor is None:
            raise ScheduleError("an interval schedule needs an anchor")
        steps = 0 if after < anchor else (after - anchor) // every + 1
        instant = anchor + steps * every
        while True:
            yield Occurrence(instant.astimezone(UTC), instant.astimezone(UTC))
            instant += every
    if kind == "cron":
        tz = zone(schedule.get("timezone", "UTC"))
        yield from _cron_occurrences(
            normalize_cron(schedule["expression"]), tz, dst or DEFAULT_DST, after
        )
        return
    raise ScheduleError(f"unknown schedule kind '{kind}'")


def gap_skipped(
    schedule: dict, *, dst: dict | None, after: dt.datetime, until: dt.datetime
) -> list[tuple[dt.datetime, dt.datetime]]:
    """Under `gap: skip`, the wall times of a cron schedule that a spring-forward in
    (after, until] removed, as (the transition instant, the naive wall time): they have no
    occurrence, so only an explanation names them. Scans the offsets hourly (bounded by
    the span asked)."""
    if schedule["kind"] != "cron" or (dst or DEFAULT_DST).get("gap", "shift") != "skip":
        return []
    tz = zone(schedule.get("timezone", "UTC"))
    expression = normalize_cron(schedule["expression"])
    found, instant, hour = [], after, dt.timedelta(hours=1)
    while instant < until:
        following = min(instant + hour, until)
        before, later = instant.astimezone(tz).utcoffset(), following.astimezone(tz).utcoffset()
        if later > before:  # a spring-forward in (instant, following]
            transition = _transition_after(instant, tz)
            gap_end = transition.astimezone(tz).replace(tzinfo=None)
            walls = croniter(expression, gap_end - (later - before) - dt.timedelta(seconds=1))
            wall = walls.get_next(dt.datetime)
            while wall < gap_end:
                found.append((transition, wall))
                wall = walls.get_next(dt.datetime)
        instant = following
    return found


def schedule_run_at(schedule: dict) -> dt.datetime:
    return dt.datetime.fromisoformat(schedule["run_at"]).astimezone(UTC)


def next_fire(
    schedule: dict,
    *,
    after: dt.datetime,
    dst: dict | None = None,
    anchor: dt.datetime | None = None,
) -> dt.datetime | None:
    """The first fire instant strictly after `after`, or None when the schedule is over."""
    if schedule["kind"] == "cron":
        dst = dst or DEFAULT_DST
        try:
            policy = tuple(sorted(dst.items()))
            hash(policy)
        except (AttributeError, TypeError):  # a spec edited by hand: asked uncached
            return _next_fire(schedule, after=after, dst=dst, anchor=anchor)
        return _cron_next_fire(
            schedule["expression"], schedule.get("timezone", "UTC"), policy, after.astimezone(UTC)
        )
    return _next_fire(schedule, after=after, dst=dst, anchor=anchor)


def _next_fire(schedule: dict, **where) -> dt.datetime | None:
    for occurrence in occurrences(schedule, **where):
        return occurrence.at
    return None


# Jobs on one expression fire at one instant, and each asks for the next (croniter costs
# about 0.2 ms a question here: for 1,000 jobs a minute that was a fifth of a second of
# every boundary's pass). The answer depends on nothing else: the DST policy is kept as it
# was given, and the instant in UTC (two wall times of a fold are two instants). An error
# is not kept.
@lru_cache(maxsize=4096)
def _cron_next_fire(
    expression: str, timezone: str, policy: tuple, after: dt.datetime
) -> dt.datetime | None:
    schedule = {"kind": "cron", "expression": expression, "timezone": timezone}
    return _next_fire(schedule, after=after, dst=dict(policy))


# Occurrences `shortest_gap` looks at: a cron expression repeats its minutes every matching
# hour and its hours every matching day, so a short gap shows among the first few (a gap
# shortened once a year by a DST transition may not: a late run then, not starvation).
GAP_SAMPLE = 50


def shortest_gap(
    schedule: dict, *, after: dt.datetime, within: int, dst: dict | None = None
) -> dt.timedelta | None:
    """A gap of at most `within` seconds between two consecutive occurrences after
    `after` (an interval's period; for cron, among the next GAP_SAMPLE occurrences), or
    None when there is none. Raises ScheduleError."""
    limit = dt.timedelta(seconds=within)
    if schedule["kind"] == "interval":
        every = dt.timedelta(seconds=schedule["every_seconds"])
        return every if every <= limit else None
    previous = None
    for count, occurrence in enumerate(occurrences(schedule, after=after, dst=dst, anchor=after)):
        if previous is not None and occurrence.at - previous <= limit:
            return occurrence.at - previous
        if count == GAP_SAMPLE:
            break
        previous = occurrence.at
    return None


def schedule_preview(
    *, schedule: dict, dst: dict, after: dt.datetime, count: int, anchor: dt.datetime | None = None
) -> list[dict]:
    """The next `count` fire instants after `after`; an interval counts from `anchor`
    (default `after`)."""
    found = []
    for occurrence in occurrences(schedule, after=after, dst=dst, anchor=anchor or after):
        found.append(occurrence)
        if len(found) > count:  # one more, to tell whether the last is doubled
            break
    walls = [occ.local.replace(tzinfo=None) for occ in found]
    return [
        {
            "at": occ.at,
            "local": occ.local.isoformat(),
            "dst": occ.dst,
            "doubled": walls.count(walls[index]) > 1 and occ.dst.startswith("fold"),
        }
        for index, occ in enumerate(found[:count])
    ]


# -- a job's fires: its schedule within start_at / end_at --------------------------------
# A backfill creates at most this many runs; a larger range is refused with 400.
BACKFILL_MAX_RUNS = 1000


def _anchor(spec: dict, created_at: dt.datetime) -> dt.datetime:
    start_at = spec.get("start_at")
    return dt.datetime.fromisoformat(start_at) if start_at else created_at


def job_next_fire(*, spec: dict, created_at: dt.datetime, after: dt.datetime) -> dt.datetime | None:
    """The occurrence after `after`, within start_at/end_at; None when the schedule is over."""
    anchor = _anchor(spec, created_at)
    start_at = spec.get("start_at")
    if start_at and after < anchor:
        after = anchor - dt.timedelta(microseconds=1)
    instant = next_fire(spec["schedule"], after=after, dst=spec.get("dst"), anchor=anchor)
    return _within_end(spec, instant)


def job_preview(*, job: Job, after: dt.datetime, count: int) -> list[dict]:
    """A job's next `count` fires after `after` as `schedule_preview` gives them (DST flags
    included), on the job's own grid and within its start_at/end_at."""
    spec = job.spec
    anchor = _anchor(spec, job.created_at)
    if spec.get("start_at"):
        after = max(after, anchor - dt.timedelta(microseconds=1))
    found = schedule_preview(schedule=spec["schedule"], dst=spec.get("dst") or DEFAULT_DST,
                             after=after, count=count, anchor=anchor)  # fmt: skip
    return [fire for fire in found if _within_end(spec, fire["at"]) is not None]


def _within_end(spec: dict, instant: dt.datetime | None) -> dt.datetime | None:
    end_at = spec.get("end_at")
    if instant is not None and end_at and instant > dt.datetime.fromisoformat(end_at):
        return None
    return instant


def job_first_fire(*, spec: dict, now: dt.datetime) -> dt.datetime | None:
    """A new job's first occurrence: at or after now (and start_at, inclusive); a one-time
    job whose run_at has passed fires at once. None when it would never fire."""
    if spec["schedule"]["kind"] == "once":
        return _within_end(spec, schedule_run_at(spec["schedule"]))
    return job_next_fire(spec=spec, created_at=now, after=now - dt.timedelta(microseconds=1))


def job_resume_point(
    *, spec: dict, created_at: dt.datetime, now: dt.datetime, since: dt.datetime | None = None
) -> dt.datetime | None:
    """The next occurrence of an edited schedule, on the job's own grid (an interval keeps
    counting from start_at or the job's creation): at or after `since` when given (the
    job's old next_run_at, already due: the occurrences missed since then meet the misfire
    policy rather than vanish), else at or after now."""
    if spec["schedule"]["kind"] == "once":
        return job_first_fire(spec=spec, now=now)
    after = min(since, now) if since is not None else now
    return job_next_fire(
        spec=spec, created_at=created_at, after=after - dt.timedelta(microseconds=1)
    )


class BackfillTooLarge(ValueError):
    """A backfill range holding more occurrences than one request may create."""


def backfill_occurrences(
    *, job: Job, start: dt.datetime, end: dt.datetime, limit: int = BACKFILL_MAX_RUNS
) -> list[dt.datetime]:
    """The job's occurrences in [start, end), by its current schedule and DST policy
    (start_at/end_at do not bound an explicit backfill; an interval's grid extends before
    its anchor). BackfillTooLarge past `limit`; ScheduleError when the schedule cannot be
    evaluated in the range (e.g. at the edge of the calendar)."""
    anchor = _anchor(job.spec, job.created_at)
    try:
        after = start - dt.timedelta(microseconds=1)
        if job.spec["schedule"]["kind"] == "interval" and start < anchor:
            # The same grid, anchor + k * every, counted from a point at or before start.
            every = dt.timedelta(seconds=job.spec["schedule"]["every_seconds"])
            anchor -= -((start - anchor) // every) * every
    except OverflowError as exc:
        raise ScheduleError("the start is out of the supported range") from exc
    found = []
    for occurrence in occurrences(
        job.spec["schedule"], after=after, dst=job.spec.get("dst"), anchor=anchor
    ):
        if occurrence.at >= end:
            break
        if len(found) == limit:
            raise BackfillTooLarge(f"the range holds more than {limit} occurrences")
        found.append(occurrence.at)
    return found
