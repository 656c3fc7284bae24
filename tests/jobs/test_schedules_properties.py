"""Property: for random cron expressions, zones, DST policies and ranges around real
transitions, the occurrences never repeat an instant, never go backwards, and are exactly
what the documented policy (docs/time.md) gives, checked against a brute-force reading of
the policy minute by minute."""

from __future__ import annotations

import datetime as dt
from functools import cache

from hypothesis import given, settings
from hypothesis import strategies as st

from jobs.schedules import job_next_fire, occurrences, zone

ZONES = [
    "America/New_York",
    "Europe/Berlin",
    "Australia/Lord_Howe",  # a 30-minute shift
    "America/Santiago",  # transitions at midnight
    "Europe/London",
    "Pacific/Chatham",  # +12:45 / +13:45
    "Asia/Kolkata",  # no DST at all
    "UTC",
]
MINUTES = ["0", "30", "15", "*/15", "*/20", "0,30", "45", "5-10"]
HOURS = ["*", "0", "1", "2", "3", "1-3", "*/2", "2,14", "0-23/5", "23"]
DAYS_OF_WEEK = ["*", "0", "1-5", "6"]
WINDOW = dt.timedelta(hours=30)
MINUTE = dt.timedelta(minutes=1)


@cache
def transitions(name: str) -> tuple[dt.datetime, ...]:
    """The instants in 2025 when `name` changes its UTC offset (hourly scan, then per minute)."""
    tz = zone(name)
    found = []
    instant = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)
    while instant.year == 2025:
        later = instant + dt.timedelta(hours=1)
        if instant.astimezone(tz).utcoffset() != later.astimezone(tz).utcoffset():
            moment = instant
            while moment.astimezone(tz).utcoffset() == instant.astimezone(tz).utcoffset():
                moment += MINUTE
            found.append(moment)
        instant = later
    return tuple(found) or (dt.datetime(2025, 3, 30, 1, tzinfo=dt.UTC),)


def expand(field: str, low: int, high: int) -> set[int]:
    values: set[int] = set()
    for part in field.split(","):
        body, _, step = part.partition("/")
        if body == "*":
            start, end = low, high
        elif "-" in body:
            start, end = (int(x) for x in body.split("-"))
        else:
            start = end = int(body)
        values.update(range(start, end + 1, int(step) if step else 1))
    return values


def matches(expression: str, wall: dt.datetime) -> bool:
    minute, hour, _, _, weekday = expression.split(" ")
    return (
        wall.minute in expand(minute, 0, 59)
        and wall.hour in expand(hour, 0, 23)
        and (wall.isoweekday() % 7) in expand(weekday, 0, 6)
    )


def expected_instants(expression: str, name: str, dst: dict, after, end) -> list[dt.datetime]:
    """The policy, read minute by minute over real instants in (after, end]."""
    tz = zone(name)
    hour = expression.split(" ")[1]
    both = dst["fold"] == "both" or (
        dst["fold"] == "auto" and (hour.startswith("*") or "/" in hour)
    )
    expected = set()
    instant = after + MINUTE
    while instant <= end:
        local = instant.astimezone(tz)
        wall = local.replace(tzinfo=None)
        if matches(expression, wall):
            ambiguous = (
                wall.replace(tzinfo=tz, fold=0).utcoffset()
                != wall.replace(tzinfo=tz, fold=1).utcoffset()
            )
            if not ambiguous or local.fold == 0 or both:
                expected.add(instant)
        previous = (instant - MINUTE).astimezone(tz)
        jump = local.utcoffset() - previous.utcoffset()
        if jump > dt.timedelta(0) and dst["gap"] == "shift":
            # A spring-forward at `instant`: the wall times it skips fire here, once.
            skipped_wall = previous.replace(tzinfo=None) + MINUTE
            while skipped_wall < wall:
                if matches(expression, skipped_wall):
                    expected.add(instant)
                    break
                skipped_wall += MINUTE
        instant += MINUTE
    return sorted(expected)


@st.composite
def cases(draw):
    name = draw(st.sampled_from(ZONES))
    transition = draw(st.sampled_from(transitions(name)))
    offset = draw(st.integers(min_value=-26 * 60, max_value=4 * 60))
    after = transition + offset * MINUTE
    expression = " ".join(
        [draw(st.sampled_from(MINUTES)), draw(st.sampled_from(HOURS)), "*", "*",
         draw(st.sampled_from(DAYS_OF_WEEK))]
    )  # fmt: skip
    dst = {
        "gap": draw(st.sampled_from(["shift", "skip"])),
        "fold": draw(st.sampled_from(["first", "both", "auto"])),
    }
    return name, expression, dst, after


@settings(max_examples=150, deadline=None)
@given(cases())
def test_occurrences_are_increasing_unique_and_follow_the_policy(case):
    name, expression, dst, after = case
    schedule = {"kind": "cron", "expression": expression, "timezone": name}
    end = after + WINDOW
    produced = []
    for occurrence in occurrences(schedule, after=after, dst=dst):
        if occurrence.at > end:
            break
        produced.append(occurrence.at)
    assert all(a < b for a, b in zip(produced, produced[1:], strict=False)), produced
    assert all(at > after for at in produced)
    assert produced == expected_instants(expression, name, dst, after, end)


@settings(max_examples=100, deadline=None)
@given(cases())
def test_materializing_one_occurrence_at_a_time_gives_the_same_sequence(case):
    """The scheduler advances a job by asking for the next occurrence after the one it
    just materialized (job_next_fire), restarting the evaluation each time, even inside a
    gap or a fold: that chain must be the uninterrupted sequence."""
    name, expression, dst, after = case
    spec = {
        "schedule": {"kind": "cron", "expression": expression, "timezone": name},
        "dst": dst,
        "start_at": None,
        "end_at": None,
    }
    end = after + WINDOW
    chained, at = [], after
    while True:
        at = job_next_fire(spec=spec, created_at=after, after=at)
        if at is None or at > end:
            break
        chained.append(at)
    assert chained == expected_instants(expression, name, dst, after, end)
