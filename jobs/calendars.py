"""Calendars: when an occurrence must not run, or the only days it may. Pure functions of a
calendar's spec and an instant, plus its validation and the iCalendar import.

A calendar's spec, read in its own zone (docs/time.md, "Calendars"):

    {"timezone": "Europe/Berlin",
     "dates": ["2026-12-25"],                                   # whole local days
     "ranges": [{"start": "2026-12-24T18:00", "end": "2026-12-27T06:00", "name": "..."}],
     "rrules": ["FREQ=YEARLY;BYMONTH=5;BYMONTHDAY=1"],          # the local days it yields
     "holidays": {"country": "DE", "subdivision": "BY"}         # or {"market": "NYSE"};
    }                                                           # "select": "business_days"

An instant is *in* a calendar when its local date is one of `dates`, a day an RRULE yields
or a holiday (with `"select": "business_days"`: a working day that is no holiday), or it
lies in a range: [start, end) as instants, each end read at its first instant when the wall
time repeats (a fall-back) and after the gap when it does not exist (a spring-forward).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
from functools import lru_cache

import holidays as holidays_lib
from dateutil import rrule as dateutil_rrule

from .schedules import ScheduleError, wall_time_instant, zone

# Bounds of one calendar: the spec stays small enough to evaluate per occurrence and to keep
# in every run's decision.
MAX_DATES = 2000
MAX_RANGES = 2000
MAX_RRULES = 50
# An iCalendar import expands recurring events over this many days from the import, at
# most IMPORT_MAX_EVENTS occurrences (an endless RRULE becomes a bounded list of ranges).
IMPORT_HORIZON_DAYS = 3 * 366
IMPORT_MAX_EVENTS = 1000
# RRULEs count from here unless they carry their own DTSTART.
RRULE_DEFAULT_START = dt.datetime(2000, 1, 1)
SELECTS = ("holidays", "business_days")
ROLES = ("exclude", "only")


class CalendarError(ValueError):
    """A calendar spec that cannot be evaluated: `field` names the part that is wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class CalendarRefused(ValueError):
    """A job names a calendar its owner cannot see (whether it exists is not said)."""


def _local_naive(value, field: str) -> dt.datetime:
    try:
        parsed = dt.datetime.fromisoformat(str(value))
    except ValueError as exc:
        raise CalendarError(
            field, f"'{value}' is not a local date-time (YYYY-MM-DDTHH:MM)"
        ) from exc
    if parsed.tzinfo is not None:
        raise CalendarError(field, "a local time in the calendar's zone, without an offset")
    return parsed


def _parse_date(value, field: str) -> dt.date:
    try:
        return dt.date.fromisoformat(str(value))
    except ValueError as exc:
        raise CalendarError(field, f"'{value}' is not a date (YYYY-MM-DD)") from exc


@lru_cache(maxsize=512)
def _rule(text: str):
    try:
        return dateutil_rrule.rrulestr(text, dtstart=RRULE_DEFAULT_START, forceset=True)
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise CalendarError("rrules", f"'{text}' is not a valid RRULE: {exc}") from exc


def _holiday_source(country: str | None, subdivision: str | None, market: str | None, year: int):
    if market:
        return holidays_lib.financial_holidays(market, years=year)
    return holidays_lib.country_holidays(country, subdiv=subdivision, years=year)


@lru_cache(maxsize=1024)
def _holidays_of(country: str | None, subdivision: str | None, market: str | None, year: int):
    try:
        return _holiday_source(country, subdivision, market, year)
    except NotImplementedError as exc:
        raise CalendarError("holidays", str(exc)) from exc


def calendar_spec_check(data) -> dict:
    """`data` validated and normalized as a calendar spec; CalendarError names the field."""
    if not isinstance(data, dict):
        raise CalendarError("non_field_errors", "must be a JSON object")
    unknown = sorted(set(data) - {"timezone", "dates", "ranges", "rrules", "holidays"})
    if unknown:
        raise CalendarError(unknown[0], "unknown field")
    try:
        zone(str(data.get("timezone", "UTC")))
    except ScheduleError as exc:
        raise CalendarError("timezone", str(exc)) from exc
    spec = {"timezone": str(data.get("timezone", "UTC"))}
    dates = _list(data, "dates", MAX_DATES)
    spec["dates"] = sorted({_parse_date(value, "dates").isoformat() for value in dates})
    ranges = []
    for item in _list(data, "ranges", MAX_RANGES):
        if not isinstance(item, dict) or not {"start", "end"} <= set(item):
            raise CalendarError("ranges", 'each range is {"start": ..., "end": ...}')
        start, end = _local_naive(item["start"], "ranges"), _local_naive(item["end"], "ranges")
        if end <= start:
            raise CalendarError("ranges", f"the range from {item['start']} ends before it starts")
        entry = {
            "start": start.isoformat(timespec="minutes"),
            "end": end.isoformat(timespec="minutes"),
        }
        if item.get("name"):
            entry["name"] = str(item["name"])[:100]
        ranges.append(entry)
    spec["ranges"] = ranges
    rrules = []
    for text in _list(data, "rrules", MAX_RRULES):
        if not isinstance(text, str) or not text.strip():
            raise CalendarError("rrules", "each RRULE is a string such as FREQ=WEEKLY;BYDAY=SA,SU")
        text = text.strip()
        rule = _rule(text)
        if rule.after(RRULE_DEFAULT_START - dt.timedelta(days=1), inc=True) is None:
            raise CalendarError("rrules", f"'{text}' yields no day")
        rrules.append(text)
    spec["rrules"] = rrules
    spec["holidays"] = _holidays_check(data.get("holidays"))
    return spec


def _list(data: dict, field: str, limit: int) -> list:
    value = data.get(field) or []
    if not isinstance(value, list):
        raise CalendarError(field, "must be a list")
    if len(value) > limit:
        raise CalendarError(field, f"at most {limit} entries")
    return value


def _holidays_check(value) -> dict | None:
    if value in (None, {}):
        return None
    if not isinstance(value, dict) or set(value) - {"country", "subdivision", "market", "select"}:
        raise CalendarError("holidays", '{"country": ..., "subdivision": ...} or {"market": ...}')
    if bool(value.get("country")) == bool(value.get("market")):
        raise CalendarError("holidays", "name either a country or a market")
    select = value.get("select", "holidays")
    if select not in SELECTS:
        raise CalendarError("holidays", f"select is one of {', '.join(SELECTS)}")
    checked = {
        "country": str(value["country"]).upper() if value.get("country") else None,
        "subdivision": str(value["subdivision"]) if value.get("subdivision") else None,
        "market": str(value["market"]).upper() if value.get("market") else None,
        "select": select,
    }
    if checked["market"] and checked["subdivision"]:
        raise CalendarError("holidays", "a market has no subdivision")
    _holidays_of(checked["country"], checked["subdivision"], checked["market"], 2026)
    return checked


# -- evaluation --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CalendarView:
    """What a decision needs of one calendar: its id, name and current spec."""

    id: str
    name: str
    spec: dict

    @property
    def label(self) -> str:
        return f"'{self.name}' ({self.id})"


def calendar_entry_at(*, spec: dict, at: dt.datetime) -> str:
    """The entry of the calendar that holds the instant `at`, in words ("" when none)."""
    tz = zone(spec["timezone"])
    local = at.astimezone(tz)
    day = local.date()
    if day.isoformat() in spec.get("dates", ()):
        return f"date {day.isoformat()}"
    for item in spec.get("ranges", ()):
        if _range_instant(item["start"], tz) <= at < _range_instant(item["end"], tz):
            name = f" {item['name']!r}" if item.get("name") else ""
            return f"range{name} {item['start']}..{item['end']}"
    for text in spec.get("rrules", ()):
        if _rule_yields(text, day):
            return f"rrule {text} on {day.isoformat()}"
    holiday = spec.get("holidays")
    if holiday:
        name = _holiday_name(holiday, day)
        if holiday["select"] == "holidays" and name:
            return f"holiday {name} on {day.isoformat()} ({_holiday_region(holiday)})"
        if holiday["select"] == "business_days" and not name and not _weekend(holiday, day):
            return f"business day {day.isoformat()} ({_holiday_region(holiday)})"
    return ""


def calendar_miss_at(*, spec: dict, at: dt.datetime) -> str:
    """Why an instant is not in the calendar, in words (for an `only` calendar)."""
    day = at.astimezone(zone(spec["timezone"])).date()
    holiday = spec.get("holidays")
    if holiday and holiday["select"] == "business_days":
        name = _holiday_name(holiday, day)
        if name:
            return f"{day.isoformat()} is {name} ({_holiday_region(holiday)})"
        return f"{day.isoformat()} is a weekend day ({_holiday_region(holiday)})"
    return f"no entry holds {at.astimezone(zone(spec['timezone'])).isoformat()}"


def calendars_skip_reason(
    *, at: dt.datetime, exclude: list[CalendarView], only: list[CalendarView]
) -> str:
    """The `calendar:` skip reason of an occurrence at `at` (already resolved by the DST
    policy), or "" when its calendars let it run: an excluding calendar that holds it, or
    (with `only` calendars) none of them holding it."""
    for calendar in exclude:
        entry = calendar_entry_at(spec=calendar.spec, at=at)
        if entry:
            return f"calendar: {calendar.label} excludes it: {entry}"[:200]
    if only and not any(calendar_entry_at(spec=calendar.spec, at=at) for calendar in only):
        first = only[0]
        why = calendar_miss_at(spec=first.spec, at=at)
        return f"calendar: outside only-calendar {first.label}: {why}"[:200]
    return ""


@lru_cache(maxsize=8192)
def _range_instant(local: str, tz) -> dt.datetime:
    """A range's end as an instant: a repeated wall time at its first instant, one that
    does not exist (a spring-forward gap) at the end of the gap."""
    return wall_time_instant(dt.datetime.fromisoformat(local), tz)


@lru_cache(maxsize=65536)
def _rule_yields(text: str, day: dt.date) -> bool:
    start = dt.datetime.combine(day, dt.time())
    found = _rule(text).after(start - dt.timedelta(microseconds=1), inc=False)
    return found is not None and found.date() == day


def _holiday_name(holiday: dict, day: dt.date) -> str:
    found = _holidays_of(holiday["country"], holiday["subdivision"], holiday["market"], day.year)
    return found.get(day) or ""


def _weekend(holiday: dict, day: dt.date) -> bool:
    found = _holidays_of(holiday["country"], holiday["subdivision"], holiday["market"], day.year)
    weekend = getattr(found, "weekend", None) or {5, 6}
    return day.weekday() in weekend


def _holiday_region(holiday: dict) -> str:
    if holiday["market"]:
        return holiday["market"]
    return "-".join(part for part in (holiday["country"], holiday["subdivision"]) if part)


# -- iCalendar import --------------------------------------------------------------------

_ICS_START = re.compile(rb"^\s*BEGIN:VCALENDAR", re.IGNORECASE)


def calendar_import_entries(*, body: bytes, spec: dict, now: dt.datetime) -> dict:
    """`spec` with the events of the iCalendar file `body` added (all-day events as dates,
    timed ones as ranges in the calendar's zone; recurring events expanded with
    recurring-ical-events over IMPORT_HORIZON_DAYS from `now`). CalendarError("body")
    when it is not an iCalendar file."""
    import icalendar
    import recurring_ical_events

    if not _ICS_START.match(body or b""):
        raise CalendarError("body", "not an iCalendar file (it must begin with BEGIN:VCALENDAR)")
    try:
        parsed = icalendar.Calendar.from_ical(body)
        events = recurring_ical_events.of(parsed).between(
            now - dt.timedelta(days=1), now + dt.timedelta(days=IMPORT_HORIZON_DAYS)
        )
    except Exception as exc:  # icalendar raises ValueError, KeyError and its own errors
        raise CalendarError("body", f"not a readable iCalendar file: {exc}") from exc
    tz = zone(spec["timezone"])
    dates, ranges = set(spec.get("dates", ())), list(spec.get("ranges", ()))
    for count, event in enumerate(events):
        if count >= IMPORT_MAX_EVENTS:
            raise CalendarError("body", f"more than {IMPORT_MAX_EVENTS} events in the horizon")
        start = event.get("DTSTART").dt if event.get("DTSTART") else None
        end = event.get("DTEND").dt if event.get("DTEND") else None
        summary = str(event.get("SUMMARY", ""))[:100]
        if start is None:
            continue
        if not isinstance(start, dt.datetime):  # all-day: each day it covers
            last = end if isinstance(end, dt.date) and end > start else start + dt.timedelta(1)
            day = start
            while day < last:
                dates.add(day.isoformat())
                day += dt.timedelta(days=1)
            continue
        end = end if isinstance(end, dt.datetime) else start + dt.timedelta(minutes=1)
        ranges.append(
            {
                "start": _wall(start, tz),
                "end": _wall(end, tz),
                **({"name": summary} if summary else {}),
            }
        )
    return calendar_spec_check({**spec, "dates": sorted(dates), "ranges": ranges})


def _wall(value: dt.datetime, tz) -> str:
    if value.tzinfo is not None:
        value = value.astimezone(tz).replace(tzinfo=None)
    return value.isoformat(timespec="minutes")
