"""Clock skew per process (dispatch.clockskew, jobs.clock): measured against the database's
clock at the midpoint of the round trip, recorded per (host, pid, kind), exported on
/metrics while fresh, deleted once expired; and Run.updated_at, which reconciliation
compares with the database's now, taken from the database's clock."""

from __future__ import annotations

import datetime as dt
import time
import types

import pytest
from django.utils import timezone

from dispatch.clockskew import ClockSkewConfig, clock_skew_run_once
from jobs import clock
from jobs.clock import CLOCK_SKEW_EXPIRY, clock_skew_measure, clock_skew_record, db_now
from jobs.models import ProcessClock, Run
from jobs.services import job_trigger
from tests.factories import make_job
from tests.jobs.test_metrics import scrape

pytestmark = pytest.mark.django_db


def skewed_clock(monkeypatch, seconds: float) -> None:
    """This process's clock `seconds` ahead (behind, when negative) of the real one."""
    shifted = types.SimpleNamespace(time=lambda: time.time() + seconds)
    monkeypatch.setattr(clock, "time", shifted)


@pytest.mark.parametrize("seconds", [300.0, -300.0, 0.0])
def test_the_skew_is_the_process_clock_minus_the_database_clock(monkeypatch, seconds):
    skewed_clock(monkeypatch, seconds)
    skew, now = clock_skew_measure()
    # The database runs on this host: only the round trip's half separates them.
    assert skew == pytest.approx(seconds, abs=0.5)
    assert abs((db_now() - now).total_seconds()) < 5


def test_each_process_has_one_row_kept_fresh_and_the_gone_are_deleted(monkeypatch):
    skewed_clock(monkeypatch, 300)
    assert clock_skew_run_once(
        now=db_now(), config=ClockSkewConfig(kind="scheduler", name="s1")
    ).skew_seconds == pytest.approx(300, abs=0.5)
    skewed_clock(monkeypatch, -2)
    clock_skew_record(kind="scheduler", name="s1")
    clock_skew_record(kind="relay")
    gone = ProcessClock.objects.create(
        host="gone", pid=1, kind="worker", skew_seconds=9,
        measured_at=db_now() - CLOCK_SKEW_EXPIRY - dt.timedelta(seconds=1),
    )  # fmt: skip
    clock_skew_record(kind="worker", name="w1@host")

    rows = {row.kind: row for row in ProcessClock.objects.all()}
    assert set(rows) == {"scheduler", "relay", "worker"}  # the gone one deleted
    assert rows["scheduler"].skew_seconds == pytest.approx(-2, abs=0.5)  # measured again
    assert rows["worker"].name == "w1@host"
    assert not ProcessClock.objects.filter(id=gone.id).exists()


def test_metrics_export_each_live_process_skew_with_its_labels(operator_api):
    now = db_now()
    ProcessClock.objects.create(host="a", pid=10, kind="scheduler", name="", skew_seconds=300.2,
                                measured_at=now)  # fmt: skip
    ProcessClock.objects.create(host="b", pid=20, kind="worker", name="w@b", skew_seconds=-299.9,
                                measured_at=now - dt.timedelta(seconds=5))  # fmt: skip
    ProcessClock.objects.create(host="c", pid=30, kind="relay", skew_seconds=1,
                                measured_at=now - CLOCK_SKEW_EXPIRY * 2)  # fmt: skip
    samples = scrape(operator_api.get("/metrics").content.decode())
    skews = {
        dict(labels)["kind"]: (dict(labels), value)
        for (name, labels), value in samples.items()
        if name == "scheduler_clock_skew_seconds"
    }
    assert skews == {
        "scheduler": ({"host": "a", "pid": "10", "kind": "scheduler", "name": ""}, 300.2),
        "worker": ({"host": "b", "pid": "20", "kind": "worker", "name": "w@b"}, -299.9),
    }  # the expired relay is not exported


def test_the_config_refuses_an_unknown_kind_and_an_interval_past_the_expiry():
    with pytest.raises(ValueError, match="kind"):
        ClockSkewConfig(kind="web")
    with pytest.raises(ValueError, match="poll_interval"):
        ClockSkewConfig(kind="relay", poll_interval=CLOCK_SKEW_EXPIRY.total_seconds())


def test_a_run_created_by_a_process_with_a_skewed_clock_is_stamped_on_the_database_clock(
    user, monkeypatch
):
    """Reconciliation takes a queued run for lost when its updated_at is old on the
    database's clock: a web process an hour slow must not make a fresh trigger look old."""
    job = make_job(user)
    real_now = timezone.now
    monkeypatch.setattr(timezone, "now", lambda: real_now() - dt.timedelta(hours=1))
    run = job_trigger(job=job, actor=user, now=db_now())
    stamped = Run.objects.get(id=run.id).updated_at
    assert abs((db_now() - stamped).total_seconds()) < 5
    assert run.updated_at == stamped  # read back with the insert
