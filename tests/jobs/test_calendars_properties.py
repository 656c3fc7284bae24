"""Property: for a minutely, an hourly and a daily job in three zones, behind calendars of
dates, local ranges, RRULEs, holidays and `only` business days (each in its own zone, not
the job's), over windows sampled across 2026 and its DST transitions, three answers agree
occurrence by occurrence, and agree with an evaluation written here from the documented
rules (docs/time.md, "Calendars"), minute by minute:

- the runs the scheduler creates (skipped or not),
- GET /jobs/{id}/occurrences/ (paged by cursor) and POST /schedules/preview/ (paged by
  `after`), asked before the scheduler ran.
"""

from __future__ import annotations

import datetime as dt
import uuid
from functools import cache

import holidays
import pytest
from django.contrib.auth import get_user_model
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jobs.calendar_services import calendar_create
from jobs.calendars import calendar_spec_check
from jobs.models import Job, JobState, Run, RunKind
from jobs.schedules import zone
from tests.factories import api_client, make_job, scheduler_pass

UTC = dt.UTC
MINUTE = dt.timedelta(minutes=1)
ZONES = ["Europe/Berlin", "America/New_York", "Australia/Sydney"]
# (cron, window): a window holds at most a few hundred occurrences.
JOBS = {
    "minutely": ("* * * * *", dt.timedelta(hours=4)),
    "hourly": ("0 * * * *", dt.timedelta(days=4)),
    "daily": ("30 2 * * *", dt.timedelta(days=45)),
}


@cache
def transitions(name: str) -> tuple[dt.datetime, ...]:
    tz, found = zone(name), []
    instant = dt.datetime(2026, 1, 1, tzinfo=UTC)
    while instant.year == 2026:
        later = instant + dt.timedelta(hours=1)
        if instant.astimezone(tz).utcoffset() != later.astimezone(tz).utcoffset():
            found.append(later)
        instant = later
    return tuple(found)


def first_at_or_after(wall: dt.datetime, tz, around: dt.datetime) -> dt.datetime:
    """The first UTC minute (from a day before `around`) whose local reading is >= wall:
    the rule for a range's ends and a daily job's time (DST gap: its end; fold: the first)."""
    instant = around.replace(second=0, microsecond=0) - dt.timedelta(days=1, hours=2)
    while instant.astimezone(tz).replace(tzinfo=None) < wall:
        instant += MINUTE
    return instant


def fires(kind: str, tz, start: dt.datetime, end: dt.datetime) -> list[dt.datetime]:
    """The job's instants in [start, end) under the default DST policy (gap shift, fold
    auto), minute by minute."""
    found, instant = [], start
    while instant < end:
        local = instant.astimezone(tz)
        if kind == "minutely" or (kind == "hourly" and local.minute == 0):
            found.append(instant)
        instant += MINUTE
    if kind != "daily":
        return found
    days = {(start + dt.timedelta(days=k)).astimezone(tz).date() for k in range(-1, 47)}
    daily = set()
    for day in days:
        wall = dt.datetime.combine(day, dt.time(2, 30))
        at = first_at_or_after(wall, tz, wall.replace(tzinfo=UTC))
        if at.astimezone(tz).date() == day and start <= at < end:
            daily.add(at)
    return sorted(daily)


def excluded_by_hand(at: dt.datetime, exclude: dict | None, only: dict | None) -> bool:
    if exclude is not None:
        tz = zone(exclude["timezone"])
        local = at.astimezone(tz)
        if local.date().isoformat() in exclude["dates"] or local.weekday() == 5:  # BYDAY=SA
            return True
        for item in exclude["ranges"]:
            start = dt.datetime.fromisoformat(item["start"])
            finish = dt.datetime.fromisoformat(item["end"])
            low = first_at_or_after(start, tz, start.replace(tzinfo=UTC))
            high = first_at_or_after(finish, tz, finish.replace(tzinfo=UTC))
            if low <= at < high:
                return True
        if local.date() in holidays.country_holidays(
            "DE", subdiv="BY", years=local.year
        ):  # the calendar's holidays
            return True
    if only is not None:
        day = at.astimezone(zone(only["timezone"])).date()
        market = holidays.financial_holidays("NYSE", years=day.year)
        return day.weekday() >= 5 or day in market
    return False


def exclude_spec(tz_name: str, around: dt.datetime, span: dt.timedelta) -> dict:
    """Dates, a range across `around` (a DST transition, often), Saturdays, Bavarian
    holidays: in `tz_name`."""
    tz = zone(tz_name)
    local = around.astimezone(tz).replace(tzinfo=None)
    return calendar_spec_check(
        {
            "timezone": tz_name,
            # A day of the window, for all but the minutely job (whose window is one day).
            "dates": [(local + max(span / 3, dt.timedelta(days=1))).date().isoformat()],
            "ranges": [
                {
                    "start": (local - span / 10).isoformat(timespec="minutes"),
                    "end": (local + span / 10).isoformat(timespec="minutes"),
                    "name": "freeze",
                }
            ],
            "rrules": ["FREQ=WEEKLY;BYDAY=SA"],
            "holidays": {"country": "DE", "subdivision": "BY"},
        }
    )


def only_spec() -> dict:
    return calendar_spec_check(
        {"timezone": "America/New_York",
         "holidays": {"market": "NYSE", "select": "business_days"}}
    )  # fmt: skip


@pytest.mark.django_db
@settings(
    max_examples=15,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@example(
    kind="minutely",
    job_zone="Europe/Berlin",
    calendar_zone="Europe/Berlin",
    transition=0,
    shift=-0.5,
    calendars="exclude",
    days=0,
)  # the freeze across the gap
@example(
    kind="minutely",
    job_zone="America/New_York",
    calendar_zone="America/New_York",
    transition=1,
    shift=-0.5,
    calendars="both",
    days=1,
)  # Monday: a working day starts
@given(
    kind=st.sampled_from(sorted(JOBS)),
    job_zone=st.sampled_from(ZONES),
    calendar_zone=st.sampled_from(ZONES),
    transition=st.integers(min_value=0, max_value=1),
    shift=st.floats(min_value=-0.6, max_value=0.4),
    calendars=st.sampled_from(["exclude", "only", "both"]),
    days=st.integers(min_value=0, max_value=2),
)
def test_scheduler_preview_and_occurrences_agree_with_an_independent_reading(
    kind, job_zone, calendar_zone, transition, shift, calendars, days
):
    expression, span = JOBS[kind]
    around = transitions(job_zone)[transition]
    # Across the transition itself (a Sunday), or a day or two later (working days).
    start = (around + span * shift).replace(minute=0, second=0, microsecond=0)
    start += dt.timedelta(days=days if kind != "daily" else 0)
    end = start + span
    owner = get_user_model().objects.create_user(f"p-{uuid.uuid4().hex[:8]}")
    exclude = exclude_spec(calendar_zone, start + span / 2, span) if calendars != "only" else None
    only = only_spec() if calendars != "exclude" else None
    named = {"exclude": [], "only": []}
    for role, spec in (("exclude", exclude), ("only", only)):
        if spec is not None:
            made = calendar_create(owner=owner, name=role, spec=spec, now=start)
            named[role].append(str(made.id))
    schedule = {"kind": "cron", "expression": expression, "timezone": job_zone}
    job = make_job(owner, now=start - dt.timedelta(microseconds=1), schedule=schedule,
                   calendars=named)  # fmt: skip
    api = api_client(owner)

    by_hand = {
        at: excluded_by_hand(at, exclude, only) for at in fires(kind, zone(job_zone), start, end)
    }

    # The occurrences endpoint, page by page, before anything ran.
    window = f"from={start.isoformat()}&to={end.isoformat()}".replace("+", "%2B")
    predicted, url = {}, f"/api/v1/jobs/{job.id}/occurrences/?limit=200&{window}"
    while url:
        body = api.get(url).json()
        for entry in body["results"]:
            at = dt.datetime.fromisoformat(entry["scheduled_for"])
            predicted[at] = entry["decision"] == "will_skip"
        url = body["next"]

    # The preview, page by page (its `after` is exclusive).
    previewed, after = {}, start - dt.timedelta(microseconds=1)
    while True:
        found = api.post("/api/v1/schedules/preview/", {
            "schedule": schedule, "after": after.isoformat(), "count": 100,
            "calendars": named}, format="json").json()["occurrences"]  # fmt: skip
        inside = [fire for fire in found if dt.datetime.fromisoformat(fire["at"]) < end]
        previewed.update({dt.datetime.fromisoformat(f["at"]): f["excluded"] for f in inside})
        if len(inside) < len(found) or not found:
            break
        after = dt.datetime.fromisoformat(found[-1]["at"])

    # The scheduler, at the end of the window (misfire run_all: late ones still run).
    for _ in range(10):  # a pass makes at most 100 occurrences of a job
        scheduler_pass(end - MINUTE / 2)
        if not Job.objects.filter(id=job.id, next_run_at__lt=end).exists():
            break
    created = {
        run.scheduled_for: run.state == "skipped"
        for run in Run.objects.filter(job=job, kind=RunKind.SCHEDULED, scheduled_for__lt=end)
    }
    Job.objects.filter(id=job.id).update(state=JobState.CANCELLED)  # out of later passes

    assert predicted == by_hand
    assert previewed == by_hand
    assert created == by_hand
