"""When schedules fire (jobs.schedules, including jobs.schedules.job_next_fire). Every clock
is pinned; expected instants are worked out by hand in UTC."""

from __future__ import annotations

import datetime as dt
import itertools

import pytest

from jobs.schedules import (
    ScheduleError,
    job_first_fire,
    job_next_fire,
    next_fire,
    normalize_cron,
    occurrences,
    zone,
)
from tests.factories import job_spec

UTC = dt.UTC


def at(text: str) -> dt.datetime:
    """An aware UTC instant from 'YYYY-MM-DDTHH:MM'."""
    return dt.datetime.fromisoformat(text).replace(tzinfo=UTC)


def cron(expression: str, timezone: str) -> dict:
    return {"kind": "cron", "expression": expression, "timezone": timezone}


def take(schedule: dict, *, after: dt.datetime, count: int, dst: dict | None = None) -> list:
    """The first `count` occurrences strictly after `after`."""
    return list(itertools.islice(occurrences(schedule, after=after, dst=dst), count))


def fires(schedule: dict, *, after: str, count: int, dst: dict | None = None) -> list[str]:
    """The next `count` fire instants after `after`, as 'YYYY-MM-DDTHH:MM' UTC strings."""
    found = take(schedule, after=at(after), count=count, dst=dst)
    return [occurrence.at.strftime("%Y-%m-%dT%H:%M") for occurrence in found]


# --- cron without transitions ---------------------------------------------------------


def test_cron_in_kolkata_fires_at_local_wall_time():
    """Asia/Kolkata is UTC+05:30 all year: 09:00 local is 03:30Z every day."""
    assert fires(cron("0 9 * * *", "Asia/Kolkata"), after="2025-03-08T12:00", count=3) == [
        "2025-03-09T03:30",
        "2025-03-10T03:30",
        "2025-03-11T03:30",
    ]


def test_cron_follows_the_zone_offset_across_seasons():
    """Berlin 09:00 on weekdays is 08:00Z in winter and 07:00Z in summer."""
    schedule = cron("0 9 * * MON-FRI", "Europe/Berlin")
    assert fires(schedule, after="2025-01-10T12:00", count=1) == ["2025-01-13T08:00"]
    assert fires(schedule, after="2025-07-04T12:00", count=1) == ["2025-07-07T07:00"]


def test_next_fire_is_strictly_after_the_given_instant():
    """An instant that is itself an occurrence is not returned again."""
    schedule = cron("0 9 * * *", "Asia/Kolkata")
    assert next_fire(schedule, after=at("2025-03-09T03:30")) == at("2025-03-10T03:30")


def test_cron_without_timezone_is_utc():
    schedule = {"kind": "cron", "expression": "15 6 * * *"}
    assert next_fire(schedule, after=at("2025-01-01T07:00")) == at("2025-01-02T06:15")


# --- spring forward: a wall time that does not exist ------------------------------------


def test_new_york_gap_shift_fires_once_at_the_transition():
    """NY 2025-03-09: 02:00 EST jumps to 03:00 EDT (07:00Z); 02:30 fires at 07:00Z."""
    schedule = cron("30 2 * * *", "America/New_York")
    assert fires(schedule, after="2025-03-08T00:00", count=3) == [
        "2025-03-08T07:30",  # 02:30 EST
        "2025-03-09T07:00",  # shifted to the end of the gap
        "2025-03-10T06:30",  # 02:30 EDT
    ]


def test_gap_shifted_occurrence_is_flagged_and_reads_as_local_0300():
    occurrence = next(
        occurrences(cron("30 2 * * *", "America/New_York"), after=at("2025-03-09T00:00"))
    )
    assert occurrence.at == at("2025-03-09T07:00")
    assert occurrence.dst == "gap_shifted"
    assert occurrence.local.strftime("%H:%M %z") == "03:00 -0400"


def test_berlin_gap_shift_fires_once_at_the_transition():
    """Berlin 2025-03-30: 02:00 CET jumps to 03:00 CEST (01:00Z); 02:30 fires at 01:00Z."""
    schedule = cron("30 2 * * *", "Europe/Berlin")
    assert fires(schedule, after="2025-03-29T00:00", count=3) == [
        "2025-03-29T01:30",
        "2025-03-30T01:00",
        "2025-03-31T00:30",
    ]


@pytest.mark.parametrize(
    ("timezone", "after", "expected"),
    [
        ("America/New_York", "2025-03-08T00:00", ["2025-03-08T07:30", "2025-03-10T06:30"]),
        ("Europe/Berlin", "2025-03-29T00:00", ["2025-03-29T01:30", "2025-03-31T00:30"]),
    ],
)
def test_gap_skip_does_not_fire_that_day(timezone, after, expected):
    """gap=skip: the wall time that does not exist is simply not an occurrence."""
    schedule = cron("30 2 * * *", timezone)
    assert fires(schedule, after=after, count=2, dst={"gap": "skip", "fold": "auto"}) == expected


def test_gap_shift_never_fires_twice_at_the_transition_instant():
    """02:00 and 02:30 both shift to 07:00Z, which is also 03:00 EDT: one occurrence."""
    schedule = cron("0,30 * * * *", "America/New_York")
    assert fires(schedule, after="2025-03-09T05:45", count=5) == [
        "2025-03-09T06:00",  # 01:00 EST
        "2025-03-09T06:30",  # 01:30 EST
        "2025-03-09T07:00",  # 02:00, 02:30 (shifted) and 03:00 EDT
        "2025-03-09T07:30",  # 03:30 EDT
        "2025-03-09T08:00",
    ]


def test_hourly_across_spring_forward_has_one_short_hour():
    """`30 * * * *`: 01:30 EST, then 02:30 shifted to 03:00 EDT, then 03:30 EDT."""
    schedule = cron("30 * * * *", "America/New_York")
    assert fires(schedule, after="2025-03-09T06:00", count=3) == [
        "2025-03-09T06:30",
        "2025-03-09T07:00",
        "2025-03-09T07:30",
    ]


# --- fall back: a wall time that happens twice -----------------------------------------


@pytest.mark.parametrize("fold", ["auto", "first"])
def test_new_york_fixed_hour_in_fold_fires_once_at_first_instant(fold):
    """NY 2025-11-02: 01:30 is 05:30Z (EDT) and 06:30Z (EST); a fixed hour fires at 05:30Z."""
    schedule = cron("30 1 * * *", "America/New_York")
    found = fires(schedule, after="2025-11-01T12:00", count=2, dst={"fold": fold})
    assert found == ["2025-11-02T05:30", "2025-11-03T06:30"]


def test_new_york_fold_both_fires_in_both_hours():
    schedule = cron("30 1 * * *", "America/New_York")
    found = take(schedule, after=at("2025-11-01T12:00"), count=3, dst={"fold": "both"})
    assert [(o.at, o.dst) for o in found] == [
        (at("2025-11-02T05:30"), "fold_first"),
        (at("2025-11-02T06:30"), "fold_second"),
        (at("2025-11-03T06:30"), ""),
    ]


def test_berlin_fold_fixed_hour_auto_fires_once_and_both_fires_twice():
    """Berlin 2025-10-26: 02:30 is 00:30Z (CEST) and 01:30Z (CET)."""
    schedule = cron("30 2 * * *", "Europe/Berlin")
    assert fires(schedule, after="2025-10-25T12:00", count=2) == [
        "2025-10-26T00:30",
        "2025-10-27T01:30",
    ]
    assert fires(schedule, after="2025-10-25T12:00", count=2, dst={"fold": "both"}) == [
        "2025-10-26T00:30",
        "2025-10-26T01:30",
    ]


@pytest.mark.parametrize("expression", ["30 * * * *", "30 */1 * * *", "@hourly"])
def test_fold_auto_with_wildcard_or_stepped_hour_fires_in_both_hours(expression):
    """A wildcard/stepped hour follows elapsed time: 01:xx EDT and 01:xx EST both fire."""
    found = fires(cron(expression, "America/New_York"), after="2025-11-02T03:45", count=4)
    minute = "00" if expression == "@hourly" else "30"
    assert found == [f"2025-11-02T{hour}:{minute}" for hour in ("04", "05", "06", "07")]


def test_fold_first_with_wildcard_hour_skips_the_repeated_hour():
    schedule = cron("30 * * * *", "America/New_York")
    assert fires(schedule, after="2025-11-02T04:00", count=3, dst={"fold": "first"}) == [
        "2025-11-02T04:30",  # 00:30 EDT
        "2025-11-02T05:30",  # 01:30 EDT
        "2025-11-02T07:30",  # 02:30 EST; 01:30 EST is not repeated
    ]


def test_after_inside_the_fold_returns_the_second_instant():
    """Starting between the two 01:30s, fold=both still owes the second one."""
    schedule = cron("30 1 * * *", "America/New_York")
    assert next_fire(schedule, after=at("2025-11-02T05:30"), dst={"fold": "both"}) == at(
        "2025-11-02T06:30"
    )


@pytest.mark.parametrize(
    ("timezone", "day_before"),
    [
        ("America/New_York", "2025-03-08T00:00"),
        ("America/New_York", "2025-11-01T00:00"),
        ("Europe/Berlin", "2025-03-29T00:00"),
        ("Europe/Berlin", "2025-10-25T00:00"),
    ],
)
@pytest.mark.parametrize("expression", ["*/15 * * * *", "0,30 1-3 * * *", "45 2 * * *"])
@pytest.mark.parametrize("fold", ["first", "both", "auto"])
@pytest.mark.parametrize("gap", ["shift", "skip"])
def test_occurrences_strictly_increase_around_transitions(
    timezone, day_before, expression, fold, gap
):
    """Whatever the policy, no instant repeats and the sequence never goes back."""
    policy = {"gap": gap, "fold": fold}
    found = [
        o.at for o in take(cron(expression, timezone), after=at(day_before), count=300, dst=policy)
    ]
    assert len(found) == 300
    assert all(earlier < later for earlier, later in itertools.pairwise(found))


def test_restarting_inside_a_transition_continues_the_same_sequence():
    """next_fire from any point equals the tail of the sequence computed from before."""
    schedule = cron("*/20 * * * *", "America/New_York")
    policy = {"gap": "shift", "fold": "both"}
    whole = [o.at for o in take(schedule, after=at("2025-11-02T03:00"), count=20, dst=policy)]
    for minutes in range(0, 300, 10):
        after = at("2025-11-02T03:00") + dt.timedelta(minutes=minutes)
        expected = next(instant for instant in whole if instant > after)
        assert next_fire(schedule, after=after, dst=policy) == expected, after


# --- interval and once -----------------------------------------------------------------


def test_interval_counts_from_the_anchor():
    schedule = {"kind": "interval", "every_seconds": 300}
    anchor = at("2030-01-01T00:00")
    first_three = itertools.islice(
        occurrences(schedule, after=at("2029-12-31T12:00"), anchor=anchor), 3
    )
    assert [o.at for o in first_three] == [
        anchor,
        anchor + dt.timedelta(minutes=5),
        anchor + dt.timedelta(minutes=10),
    ]


@pytest.mark.parametrize(
    ("after_seconds", "expected_seconds"), [(0, 300), (1, 300), (299, 300), (300, 600), (301, 600)]
)
def test_interval_next_fire_stays_on_the_anchor_grid(after_seconds, expected_seconds):
    anchor = at("2030-01-01T00:00")
    after = anchor + dt.timedelta(seconds=after_seconds)
    found = next_fire({"kind": "interval", "every_seconds": 300}, after=after, anchor=anchor)
    assert found == anchor + dt.timedelta(seconds=expected_seconds)


def test_interval_without_anchor_is_an_error():
    with pytest.raises(ScheduleError, match="anchor"):
        next_fire({"kind": "interval", "every_seconds": 60}, after=at("2030-01-01T00:00"))


def test_once_fires_only_if_run_at_is_after():
    schedule = {"kind": "once", "run_at": "2030-01-01T09:00:00+00:00"}
    assert next_fire(schedule, after=at("2030-01-01T08:59")) == at("2030-01-01T09:00")
    assert next_fire(schedule, after=at("2030-01-01T09:00")) is None


def test_once_run_at_with_offset_is_read_as_utc():
    schedule = {"kind": "once", "run_at": "2030-01-01T09:00:00+05:30"}
    assert next_fire(schedule, after=at("2029-12-31T00:00")) == at("2030-01-01T03:30")


def test_first_fire_of_once_in_the_past_still_fires():
    """A one-time job created after its run_at runs (late) rather than never."""
    spec = job_spec(schedule={"kind": "once", "run_at": "2020-01-01T00:00:00+00:00"})
    assert job_first_fire(spec=spec, now=at("2025-06-01T00:00")) == at("2020-01-01T00:00")


def test_first_fire_of_interval_is_a_future_start_at_or_the_next_step():
    spec = job_spec(
        schedule={"kind": "interval", "every_seconds": 3600}, start_at="2030-01-01T00:00:00Z"
    )
    assert job_first_fire(spec=spec, now=at("2029-12-01T00:00")) == at("2030-01-01T00:00")
    assert job_first_fire(spec=spec, now=at("2030-01-01T01:30")) == at("2030-01-01T02:00")


def test_first_fire_of_cron_includes_a_start_at_that_is_an_occurrence():
    """start_at is inclusive for cron as for interval schedules."""
    spec = job_spec(
        schedule={"kind": "cron", "expression": "0 9 * * *"}, start_at="2030-01-05T09:00:00Z"
    )
    assert job_first_fire(spec=spec, now=at("2029-12-01T00:00")) == at("2030-01-05T09:00")


def test_first_fire_of_cron_at_creation_instant_fires_now():
    spec = job_spec(schedule={"kind": "cron", "expression": "0 9 * * *"})
    assert job_first_fire(spec=spec, now=at("2030-01-05T09:00")) == at("2030-01-05T09:00")


def test_cron_that_only_matches_dst_gaps_never_fires_under_gap_skip():
    """Last Sunday of March at 02:30 in Berlin is always in the gap: skip means never."""
    schedule = {"kind": "cron", "expression": "30 2 * 3 L0", "timezone": "Europe/Berlin"}
    with pytest.raises(ScheduleError, match="never fires"):
        next_fire(schedule, after=at("2026-01-01T00:00"), dst={"gap": "skip", "fold": "auto"})
    shifted = next_fire(
        schedule, after=at("2026-01-01T00:00"), dst={"gap": "shift", "fold": "auto"}
    )
    assert shifted == at("2026-03-29T01:00")


def test_schedule_past_year_9999_is_a_schedule_error():
    schedule = {"kind": "cron", "expression": "0 0 * * *", "timezone": "Europe/Berlin"}
    with pytest.raises(ScheduleError, match="cannot be evaluated"):
        next_fire(schedule, after=dt.datetime(9999, 12, 31, 12, tzinfo=UTC))


@pytest.mark.parametrize("expression", ["R 9 * * *", "H 9 * * *", "0 H(0-5) * * *", "H/5 * * * *"])
def test_random_and_hashed_cron_values_are_refused(expression):
    """They change between evaluations: one daily job would get two runs in a day."""
    with pytest.raises(ScheduleError, match="not supported"):
        normalize_cron(expression)


def test_day_and_month_names_are_not_mistaken_for_hashed_values():
    assert normalize_cron("0 9 * MAR THU,FRI") == "0 9 * MAR THU,FRI"


def test_unknown_kind_is_an_error():
    with pytest.raises(ScheduleError, match="kind"):
        next_fire({"kind": "sometimes"}, after=at("2030-01-01T00:00"))


# --- normalize_cron and zone ----------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "normalized"),
    [
        ("@daily", "0 0 * * *"),
        ("@DAILY", "0 0 * * *"),
        ("@midnight", "0 0 * * *"),
        ("@hourly", "0 * * * *"),
        ("@weekly", "0 0 * * 0"),
        ("  0   9 *  * MON-FRI ", "0 9 * * MON-FRI"),
    ],
)
def test_normalize_cron_expands_aliases_and_whitespace(given, normalized):
    assert normalize_cron(given) == normalized


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("0 0 * * * *", "5 fields"),  # seconds field (6 fields)
        ("0 9 * *", "5 fields"),
        ("@reboot", "5 fields"),
        ("", "5 fields"),
        ("61 * * * *", "not a valid cron"),
        ("0 25 * * *", "not a valid cron"),
        ("a b c d e", "not a valid cron"),
    ],
)
def test_normalize_cron_refuses_bad_expressions(expression, message):
    with pytest.raises(ScheduleError, match=message):
        normalize_cron(expression)


def test_cron_that_never_fires_is_a_schedule_error():
    """February 31st never comes: a ScheduleError, not croniter's internal exception."""
    with pytest.raises(ScheduleError):
        next_fire(cron("0 0 31 2 *", "UTC"), after=at("2025-01-01T00:00"))


def test_zone_knows_iana_names():
    assert zone("Asia/Kolkata").utcoffset(dt.datetime(2025, 1, 1)) == dt.timedelta(
        hours=5, minutes=30
    )


@pytest.mark.parametrize("name", ["Mars/Olympus_Mons", "", "../etc/passwd", "Europe/Berlin "])
def test_zone_refuses_unknown_names(name):
    with pytest.raises(ScheduleError, match="not a known IANA time zone"):
        zone(name)


# --- job_next_fire: start_at and end_at -------------------------------------------------


def test_job_next_fire_cron_waits_for_start_at():
    spec = job_spec(schedule=cron("0 9 * * *", "UTC"), start_at="2030-01-05T00:00:00Z")
    found = job_next_fire(
        spec=spec, created_at=at("2030-01-01T00:00"), after=at("2030-01-01T00:00")
    )
    assert found == at("2030-01-05T09:00")


def test_job_next_fire_fires_at_start_at_when_it_is_an_occurrence():
    spec = job_spec(schedule=cron("0 9 * * *", "UTC"), start_at="2030-01-05T09:00:00Z")
    found = job_next_fire(
        spec=spec, created_at=at("2030-01-01T00:00"), after=at("2030-01-01T00:00")
    )
    assert found == at("2030-01-05T09:00")


def test_job_next_fire_interval_is_anchored_at_start_at_not_creation():
    spec = job_spec(
        schedule={"kind": "interval", "every_seconds": 3600}, start_at="2030-01-01T00:20:00Z"
    )
    created = at("2029-12-31T23:00")
    assert job_next_fire(spec=spec, created_at=created, after=created) == at("2030-01-01T00:20")
    assert job_next_fire(spec=spec, created_at=created, after=at("2030-01-01T00:20")) == at(
        "2030-01-01T01:20"
    )


def test_job_next_fire_interval_without_start_at_counts_from_creation():
    spec = job_spec(schedule={"kind": "interval", "every_seconds": 600})
    created = at("2030-01-01T00:07")
    assert job_next_fire(spec=spec, created_at=created, after=at("2030-01-01T00:20")) == at(
        "2030-01-01T00:27"
    )


def test_job_next_fire_includes_end_at_and_stops_after_it():
    spec = job_spec(schedule=cron("0 9 * * *", "UTC"), end_at="2030-01-02T09:00:00Z")
    created = at("2030-01-01T00:00")
    assert job_next_fire(spec=spec, created_at=created, after=at("2030-01-01T09:00")) == at(
        "2030-01-02T09:00"
    )
    assert job_next_fire(spec=spec, created_at=created, after=at("2030-01-02T09:00")) is None


# --- retry policy ----------------------------------------------------------------------


def test_next_fire_of_cron_is_kept_per_expression_zone_dst_and_instant():
    """The next fire is kept for the jobs that share an expression (jobs.schedules), keyed
    on all it depends on: another zone, DST policy or instant is not answered from it, and
    what `occurrences` gives is what it answers."""
    after = dt.datetime(2025, 3, 9, 6, 45, tzinfo=dt.UTC)  # 01:45 EST, before the gap
    expected = {
        (zone_name, gap): next(iter(occurrences(cron("30 2 * * *", zone_name), after=after,
                                                dst={"gap": gap, "fold": "auto"}))).at
        for zone_name in ("America/New_York", "Europe/Berlin") for gap in ("shift", "skip")
    }  # fmt: skip
    new_york, berlin = "America/New_York", "Europe/Berlin"
    # Answers that differ by zone and by gap policy alone: none may stand in for another.
    assert expected[new_york, "shift"] != expected[new_york, "skip"]
    assert expected[new_york, "shift"] != expected[berlin, "shift"]
    for _ in range(2):  # the second round is answered from what the first kept
        for (zone_name, gap), at in expected.items():
            schedule = cron("30 2 * * *", zone_name)
            assert next_fire(schedule, after=after, dst={"gap": gap, "fold": "auto"}) == at
    later = after + dt.timedelta(days=1)
    assert (
        next_fire(cron("30 2 * * *", "America/New_York"), after=later)
        == next(iter(occurrences(cron("30 2 * * *", "America/New_York"), after=later))).at
    )
    with pytest.raises(ScheduleError):
        next_fire(cron("0 0 30 2 *", "UTC"), after=after)  # 30 February: never
    # The two 01:30 of New York's fold are two instants, though equal as wall times.
    quarter = cron("*/15 * * * *", "America/New_York")
    for fold in (0, 1):
        local = dt.datetime(2025, 11, 2, 1, 30, fold=fold, tzinfo=zone("America/New_York"))
        assert next_fire(quarter, after=local) == next(iter(occurrences(quarter, after=local))).at
