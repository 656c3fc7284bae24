"""The DST tables of docs/time.md, computed by jobs.schedules itself.

`python -m tests.jobs.dst_tables` prints them; tests/jobs/test_schedules_dst.py fails when the
document and the implementation disagree, so the tables in the docs stay true.
"""

from __future__ import annotations

import datetime as dt

from jobs.schedules import FOLD_POLICIES, GAP_POLICIES, occurrences, zone

BEGIN, END = "<!-- dst-tables:begin -->", "<!-- dst-tables:end -->"
# (zone, transition instant, the fixed-hour expression whose hour the transition moves)
TRANSITION_DAYS = [
    ("America/New_York", dt.datetime(2025, 3, 9, 7, 0, tzinfo=dt.UTC), "30 2 * * *"),
    ("America/New_York", dt.datetime(2025, 11, 2, 6, 0, tzinfo=dt.UTC), "30 1 * * *"),
    ("Europe/Berlin", dt.datetime(2025, 3, 30, 1, 0, tzinfo=dt.UTC), "30 2 * * *"),
    ("Europe/Berlin", dt.datetime(2025, 10, 26, 1, 0, tzinfo=dt.UTC), "30 2 * * *"),
]
WILDCARD_HOUR = "30 * * * *"
NOTES = {"gap_shifted": " shifted", "fold_first": " 1st", "fold_second": " 2nd", "": ""}


def fires(
    expression: str, timezone: str, dst: dict, start: dt.datetime, end: dt.datetime
) -> list[str]:
    """Each fire instant in [start, end) as `local (UTC) note`."""
    schedule = {"kind": "cron", "expression": expression, "timezone": timezone}
    found = []
    for occurrence in occurrences(schedule, after=start - dt.timedelta(seconds=1), dst=dst):
        if occurrence.at >= end:
            break
        local = occurrence.local
        found.append(
            f"{local:%H:%M} {local.tzname()} ({occurrence.at:%H:%M}Z){NOTES[occurrence.dst]}"
        )
    return found


def local_day(timezone: str, transition: dt.datetime) -> tuple[dt.datetime, dt.datetime]:
    """The local calendar day of `transition`, as UTC instants [midnight, next midnight)."""
    tz = zone(timezone)
    midnight = transition.astimezone(tz).replace(hour=0, minute=0, tzinfo=None)
    return tuple(
        (midnight + dt.timedelta(days=days)).replace(tzinfo=tz).astimezone(dt.UTC)
        for days in (0, 1)
    )


def table(timezone: str, transition: dt.datetime, fixed: str) -> str:
    """Every gap and fold value; a policy with no effect that day is shown as `any` (only
    where every one of its values gives the same fires, which is computed, not assumed)."""
    tz = zone(timezone)
    before, after = ((transition + dt.timedelta(minutes=m)).astimezone(tz) for m in (-1, 0))
    kind = "spring forward" if after.utcoffset() > before.utcoffset() else "fall back"
    old_wall = (transition + before.utcoffset()).replace(tzinfo=None)
    # Fixed hour: the whole local day; wildcard hour: 90 minutes either side.
    day = local_day(timezone, transition)
    near = (transition - dt.timedelta(minutes=90), transition + dt.timedelta(minutes=90, seconds=1))
    cells = {}
    for gap in GAP_POLICIES:
        for fold in FOLD_POLICIES:
            dst = {"gap": gap, "fold": fold}
            cells[gap, fold] = (
                ", ".join(fires(fixed, timezone, dst, *day)) or "(none)",
                ", ".join(fires(WILDCARD_HOUR, timezone, dst, *near)) or "(none)",
            )
    if all(len({cells[g, f] for f in FOLD_POLICIES}) == 1 for g in GAP_POLICIES):
        rows = [(g, "any", cells[g, FOLD_POLICIES[0]]) for g in GAP_POLICIES]
    elif all(len({cells[g, f] for g in GAP_POLICIES}) == 1 for f in FOLD_POLICIES):
        rows = [("any", f, cells[GAP_POLICIES[0], f]) for f in FOLD_POLICIES]
    else:
        rows = [(g, f, cells[g, f]) for g in GAP_POLICIES for f in FOLD_POLICIES]
    lines = [
        f"### {timezone}, {transition.astimezone(tz):%Y-%m-%d}: {kind}, clocks go from "
        f"{old_wall:%H:%M} {before.tzname()} to {after:%H:%M} {after.tzname()} at "
        f"{transition:%H:%M}Z",
        "",
        f"| gap | fold | `{fixed}`, that local day | `{WILDCARD_HOUR}`, "
        f"{near[0]:%H:%M}Z to {near[1]:%H:%M}Z |",
        "|---|---|---|---|",
        *(
            f"| {gap} | {fold} | {fixed_fires} | {hourly} |"
            for gap, fold, (fixed_fires, hourly) in rows
        ),
    ]
    return "\n".join(lines)


def render() -> str:
    body = "\n\n".join(table(*day) for day in TRANSITION_DAYS)
    return f"{BEGIN}\n{body}\n{END}"


if __name__ == "__main__":
    print(render())
