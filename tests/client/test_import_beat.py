"""`schedctl import-beat module:app`: a Celery beat schedule of every kind becomes a jobs
file; applied, each job's next fires (`schedules/preview/`) are the ones Celery's own
schedule objects compute; what cannot be carried over is named."""

from __future__ import annotations

import datetime as dt
import importlib
import sys
import textwrap
from zoneinfo import ZoneInfo

import pytest
import yaml

from jobs.models import Job
from scheduler_client import Client
from tests.factories import owner, token_for

from .helpers import ok, schedctl

BEAT_MODULE = textwrap.dedent(
    """
    from datetime import timedelta

    from celery import Celery
    from celery.schedules import crontab, schedule, solar


    class every_other_day(schedule):
        '''A custom schedule class: beat's own subclass, nothing to carry it as.'''


    # A solar schedule as beat holds it (its constructor wants ephem, celery[solar]).
    sunrise = solar.__new__(solar)
    sunrise.event, sunrise.lat, sunrise.lon = "sunrise", 52.52, 13.40

    app = Celery("beatproj", set_as_current=False)
    app.conf.timezone = "America/New_York"
    app.conf.beat_schedule = {
        "heartbeat-seconds": {"task": "tests.record", "schedule": 30.0, "args": [1]},
        "sweep-timedelta": {"task": "tests.record", "schedule": timedelta(minutes=5),
                            "kwargs": {"mode": "sweep"}},
        "hourly-schedule-object": {"task": "tests.record",
                                   "schedule": schedule(run_every=timedelta(hours=1))},
        "weekday-morning": {"task": "tests.record",
                            "schedule": crontab(minute=30, hour=7, day_of_week="mon-fri"),
                            "args": ["report"], "options": {"queue": "jobs"}},
        "quarter-hours": {"task": "tests.record", "schedule": crontab(minute="*/15")},
        "month-start": {"task": "tests.record",
                        "schedule": crontab(minute=0, hour=0, day_of_month=1)},
        "christmas-noon": {"task": "tests.record",
                           "schedule": crontab(minute=0, hour=12, day_of_month=25,
                                               month_of_year=12)},
        "sunday-night": {"task": "tests.record",
                         "schedule": crontab(minute=59, hour=23, day_of_week=0)},
        "office-hours": {"task": "tests.record",
                         "schedule": crontab(minute=0, hour="9,12,17"),
                         "options": {"priority": 5, "expires": 60}},
        "business-ticks": {"task": "tests.record",
                           "schedule": crontab(minute="0,30", hour="9-17",
                                               day_of_week="1-5")},
        "sunrise": {"task": "tests.record", "schedule": sunrise},
        "custom-class": {"task": "tests.record",
                         "schedule": every_other_day(run_every=timedelta(days=2))},
        "not-a-job-task": {"task": "legacy.cleanup", "schedule": 60.0},
        "both-days": {"task": "tests.record",
                      "schedule": crontab(minute=0, hour=0, day_of_month=13, day_of_week=5)},
        "half-seconds": {"task": "tests.record", "schedule": 2.5},
    }
    """
)
CARRIED = {"heartbeat-seconds", "sweep-timedelta", "hourly-schedule-object", "weekday-morning",
           "quarter-hours", "month-start", "christmas-noon", "sunday-night", "office-hours",
           "business-ticks"}  # fmt: skip
NOT_CARRIED = {"sunrise", "custom-class", "not-a-job-task", "both-days", "half-seconds"}
AFTER = dt.datetime(2026, 6, 10, 13, 37, tzinfo=dt.UTC)  # a Wednesday, far from DST changes


def celery_next_fires(sched, tz: ZoneInfo, count: int) -> list[dt.datetime]:
    """What beat computes: the next `count` due instants after AFTER, by the schedule
    object itself (each from the one before, as beat's last_run_at)."""
    from celery.schedules import crontab

    found, last = [], AFTER.astimezone(tz)
    for _ in range(count):
        if isinstance(sched, crontab):
            start, delta, _now = sched.remaining_delta(last)
            upcoming = start + delta
        else:
            upcoming = last + sched.run_every
        found.append(upcoming.astimezone(dt.UTC))
        last = upcoming
    return found


@pytest.fixture
def beat_app(tmp_path, monkeypatch):
    (tmp_path / "beatproj.py").write_text(BEAT_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("beatproj")
    yield module.app
    sys.modules.pop("beatproj", None)


def test_import_beat_then_apply_fires_when_celery_would(live_server, transactional_db,
                                                        tmp_path, beat_app):  # fmt: skip
    token = token_for(owner("beat"))
    written = ok(schedctl("import-beat", "beatproj:app", "-w", "jobs.yaml",
                          url=live_server.url, token=token, cwd=tmp_path))  # fmt: skip
    document = yaml.safe_load((tmp_path / "jobs.yaml").read_text())
    bodies = {body["name"]: body for body in document["jobs"]}
    assert set(bodies) == CARRIED
    header = (tmp_path / "jobs.yaml").read_text().split("jobs:")[0]
    for name in NOT_CARRIED:
        assert f"not carried over: {name}:" in written.stderr, written.stderr
        assert f"#   {name}:" in header
    assert "solar schedule (sunrise)" in written.stderr
    assert "custom schedule class beatproj.every_other_day" in written.stderr
    assert "task 'legacy.cleanup' is not a registered job task" in written.stderr
    assert "office-hours: options not carried: expires" in written.stderr

    assert bodies["heartbeat-seconds"]["args"] == [1]
    assert bodies["sweep-timedelta"] == {
        "name": "sweep-timedelta",
        "task": "tests.record",
        "schedule": {"kind": "interval", "every_seconds": 300},
        "kwargs": {"mode": "sweep"},
    }
    assert bodies["weekday-morning"]["schedule"] == {
        "kind": "cron",
        "expression": "30 7 * * MON-FRI",
        "timezone": "America/New_York",
    }
    assert bodies["weekday-morning"]["queue"] == "jobs"
    assert bodies["office-hours"]["priority"] == 5

    applied = ok(schedctl("apply", "-f", "jobs.yaml", "-o", "json",
                          url=live_server.url, token=token, cwd=tmp_path)).json()  # fmt: skip
    assert {c["action"] for c in applied["changes"]} == {"create"}
    assert Job.objects.filter(name__in=CARRIED).count() == len(CARRIED)

    client = Client(live_server.url, token)
    tz = ZoneInfo(str(beat_app.conf.timezone))
    for name in sorted(CARRIED):
        sched = beat_app.conf.beat_schedule[name]["schedule"]
        if not hasattr(sched, "remaining_delta") and not hasattr(sched, "run_every"):
            sched = type("seconds", (), {"run_every": _as_timedelta(sched)})()
        if hasattr(sched, "app"):
            sched.app = beat_app
        job = Job.objects.get(name=name)
        preview = client.schedule_preview(job.spec["schedule"], after=AFTER.isoformat(), count=3)
        ours = [dt.datetime.fromisoformat(o.at.replace("Z", "+00:00")) for o in preview]
        assert ours == celery_next_fires(sched, tz, 3), name


def _as_timedelta(value) -> dt.timedelta:
    return value if isinstance(value, dt.timedelta) else dt.timedelta(seconds=value)
