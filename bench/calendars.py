"""Calendars at scale: (1) a page of GET /jobs/{id}/occurrences/ over a year of a minutely
job behind a holiday calendar and a two-week freeze costs the same at the start of the year
as at its end; (2) editing a calendar named by 1 of N jobs touches that job only, through
the link index (the plan of the statement that finds them is printed).

    .venv/bin/python -m bench.calendars [--jobs 100000] [--repeat 20]

A fresh PostgreSQL database (dropped afterwards). The pages are asked through the API
(DRF's test client: routing, authentication, serialization, the decision of each entry).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time

from bench.common import RESULTS, bench_environment

UTC = dt.UTC


def _median_ms(function, repeat: int) -> float:
    took = []
    for _ in range(repeat):
        start = time.perf_counter()
        function()
        took.append((time.perf_counter() - start) * 1000)
    return statistics.median(took)


def paging(*, repeat: int) -> dict:
    from django.contrib.auth import get_user_model
    from rest_framework.test import APIClient

    from jobs.calendar_services import calendar_create
    from jobs.calendars import calendar_spec_check
    from jobs.models import Job
    from jobs.occurrences import cursor_encode
    from tests.factories import make_job, token_for

    owner = get_user_model().objects.create_user("bench-paging")
    now = dt.datetime.now(UTC).replace(second=0, microsecond=0)
    year = now.year + 1
    spec = calendar_spec_check(
        {
            "timezone": "Europe/Berlin",
            "ranges": [{"start": f"{year}-03-20T00:00", "end": f"{year}-04-03T00:00",
                        "name": "two-week freeze across the DST change"}],
            "holidays": {"country": "DE", "subdivision": "BY"},
        }
    )  # fmt: skip
    calendar = calendar_create(owner=owner, name="holidays and freeze", spec=spec, now=now)
    job = make_job(
        owner,
        now=now,
        schedule={"kind": "cron", "expression": "* * * * *", "timezone": "Europe/Berlin"},
        calendars={"exclude": [str(calendar.id)]},
    )
    Job.objects.filter(id=job.id).update(next_run_at=dt.datetime(year, 1, 1, tzinfo=UTC))
    api = APIClient(SERVER_NAME="localhost")
    api.credentials(HTTP_AUTHORIZATION=f"Token {token_for(owner)}")
    start, end = dt.datetime(year, 1, 1, tzinfo=UTC), dt.datetime(year, 12, 31, tzinfo=UTC)
    window = f"from={start.isoformat()}&to={end.isoformat()}".replace("+", "%2B")
    pages = {
        "first": f"/api/v1/jobs/{job.id}/occurrences/?{window}&limit=100",
        "freeze": f"/api/v1/jobs/{job.id}/occurrences/?{window}&limit=100&cursor="
        + cursor_encode(dt.datetime(year, 3, 29, 0, 30, tzinfo=UTC)),
        "last": f"/api/v1/jobs/{job.id}/occurrences/?{window}&limit=100&cursor="
        + cursor_encode(end - dt.timedelta(minutes=100)),
    }
    figures = {}
    for name, url in pages.items():
        body = api.get(url).json()
        assert len(body["results"]) == 100 or name == "last", body
        skipped = sum(entry["decision"] == "will_skip" for entry in body["results"])
        figures[name] = {
            "median_ms": round(_median_ms(lambda url=url: api.get(url), repeat), 2),
            "entries": len(body["results"]),
            "will_skip": skipped,
        }
    return figures


def calendar_edit(*, jobs: int) -> dict:
    from django.contrib.auth import get_user_model
    from django.db import connection, transaction

    from jobs.calendar_services import calendar_create, calendar_update
    from jobs.calendars import calendar_spec_check
    from jobs.models import AuditEvent, Job, JobCalendar
    from jobs.services import job_create_bulk
    from tests.factories import job_spec

    owner = get_user_model().objects.create_user("bench-edit")
    now = dt.datetime.now(UTC)
    spec = calendar_spec_check({"timezone": "Europe/Berlin", "dates": ["2027-01-01"]})
    named = calendar_create(owner=owner, name="named by one", spec=spec, now=now)
    others = [calendar_create(owner=owner, name=f"other {k}", spec=spec, now=now)
              for k in range(10)]  # fmt: skip
    schedule = {"kind": "cron", "expression": "0 9 * * *", "timezone": "Europe/Berlin"}
    base = job_spec(schedule=schedule)
    made = time.perf_counter()
    for offset in range(0, jobs, 1000):
        specs = [
            {**base, "name": f"job {offset + k}",
             "calendars": {"exclude": [str(others[(offset + k) % 10].id)], "only": []}}
            for k in range(min(1000, jobs - offset))
        ]  # fmt: skip
        if offset == 0:
            specs[0] = {**specs[0], "calendars": {"exclude": [str(named.id)], "only": []}}
        with transaction.atomic():
            job_create_bulk(owner=owner, specs=specs, now=now)
    made = time.perf_counter() - made
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE jobs_job; ANALYZE jobs_jobcalendar")
        cursor.execute(
            "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) SELECT job.id FROM jobs_job AS job "
            "WHERE job.id IN (SELECT job_id FROM jobs_jobcalendar WHERE calendar_id = %s) "
            "AND job.deleted_at IS NULL FOR UPDATE",
            [named.id],
        )
        plan = [row[0] for row in cursor.fetchall()]
    before = dict(Job.objects.values_list("id", "updated_at"))
    edit = time.perf_counter()
    assert calendar_update(calendar=named, name=named.name,
                           spec={**spec, "dates": ["2027-01-01", "2027-01-02"]},
                           expected_version=1, actor=owner, now=now)  # fmt: skip
    edit = time.perf_counter() - edit
    after = dict(Job.objects.values_list("id", "updated_at"))
    touched = [job_id for job_id, at in after.items() if before[job_id] != at]
    return {
        "jobs": jobs,
        "links": JobCalendar.objects.count(),
        "create_seconds": round(made, 1),
        "edit_ms": round(edit * 1000, 2),
        "jobs_touched": len(touched),
        "audit_events": AuditEvent.objects.filter(action="job.calendar_changed").count(),
        "plan": plan,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    with bench_environment("bench_calendars", task_modules="tests.sample_tasks"):
        figures = {"paging": paging(repeat=args.repeat), "edit": calendar_edit(jobs=args.jobs)}
    print(json.dumps(figures, indent=2))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "calendars.json").write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
