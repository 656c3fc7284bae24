"""Calendars: the API (validation, owner scope, versions and audit, iCalendar import), a
job's `calendars`, the skipped runs the scheduler records, and the explanation of a job's
occurrences (GET /jobs/{id}/occurrences/) against the runs made later."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from jobs.calendar_services import calendar_update
from jobs.models import AuditEvent, Calendar, CalendarVersion, Job, JobCalendar, Run
from jobs.occurrences import job_occurrences
from tests.factories import scheduled_runs, scheduler_pass

UTC = dt.UTC
MINUTE = dt.timedelta(minutes=1)
BERLIN = {"name": "Bavaria", "timezone": "Europe/Berlin",
          "holidays": {"country": "DE", "subdivision": "BY"}}  # fmt: skip


def create_calendar(api, **body) -> dict:
    response = api.post("/api/v1/calendars/", {**BERLIN, **body}, format="json")
    assert response.status_code == 201, response.json()
    return response.json()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"timezone": "Mars/Olympus"}, "timezone"),
        ({"rrules": ["FREQ=SOMETIMES"]}, "rrules"),
        ({"holidays": {"country": "XX"}}, "holidays"),
        ({"holidays": {"country": "DE", "subdivision": "ZZ"}}, "holidays"),
        ({"ranges": [{"start": "2026-12-27T06:00", "end": "2026-12-24T18:00"}]}, "ranges"),
        ({"dates": ["2026-13-01"]}, "dates"),
    ],
)
def test_a_bad_calendar_answers_400_naming_the_field_and_writes_nothing(api, body, field):
    response = api.post("/api/v1/calendars/", {**BERLIN, **body}, format="json")
    assert response.status_code == 400
    assert field in response.json(), response.json()
    assert not Calendar.objects.exists() and not AuditEvent.objects.exists()


def test_an_import_that_is_not_ics_answers_400_and_changes_nothing(api):
    calendar = create_calendar(api)
    response = api.post(f"/api/v1/calendars/{calendar['id']}/import/", b"hello",
                        content_type="text/calendar")  # fmt: skip
    assert response.status_code == 400 and "body" in response.json()
    assert Calendar.objects.get(id=calendar["id"]).version == 1


ICS = b"""BEGIN:VCALENDAR
VERSION:2.0
PRODID:-//test//EN
BEGIN:VEVENT
UID:1
SUMMARY:Release freeze
DTSTART;TZID=Europe/Berlin:20261214T000000
DTEND;TZID=Europe/Berlin:20261228T000000
END:VEVENT
BEGIN:VEVENT
UID:2
SUMMARY:Team day
DTSTART;VALUE=DATE:20261106
RRULE:FREQ=YEARLY;COUNT=2
END:VEVENT
END:VCALENDAR
"""


def test_an_ics_import_adds_its_events_as_a_new_audited_version(api):
    calendar = create_calendar(api)
    response = api.post(f"/api/v1/calendars/{calendar['id']}/import/", ICS,
                        content_type="text/calendar")  # fmt: skip
    assert response.status_code == 200, response.json()
    body = response.json()
    assert body["version"] == 2
    assert {"start": "2026-12-14T00:00", "end": "2026-12-28T00:00", "name": "Release freeze"} in (
        body["ranges"]
    )
    assert body["dates"] == ["2027-11-06"]  # expanded from the import on (2026-11-06 passed)
    assert CalendarVersion.objects.filter(calendar_id=calendar["id"]).count() == 2
    assert AuditEvent.objects.filter(action="calendar.updated").count() == 1


def test_calendars_are_owner_scoped_and_a_job_cannot_name_another_owners(api, other_user, user):
    from tests.factories import api_client

    theirs = create_calendar(api_client(other_user))
    assert api.get(f"/api/v1/calendars/{theirs['id']}/").status_code == 404
    schedule = {"kind": "cron", "expression": "0 9 * * *", "timezone": "Europe/Berlin"}
    body = {"name": "j", "task": "tests.record", "schedule": schedule}
    for named in (theirs["id"], "00000000-0000-0000-0000-000000000001"):
        response = api.post("/api/v1/jobs/", {**body, "calendars": {"exclude": [named]}},
                            format="json")  # fmt: skip
        assert response.status_code == 400
        assert response.json() == {"calendars": [f"calendar {named} is not one of yours"]}
    assert not Job.objects.filter(owner=user).exists()


def cron_job(api, expression, zone, **extra) -> dict:
    schedule = {"kind": "cron", "expression": expression, "timezone": zone}
    body = {"name": "j", "task": "tests.record", "schedule": schedule, **extra}
    response = api.post("/api/v1/jobs/", body, format="json")
    assert response.status_code == 201, response.json()
    return response.json()


def test_an_excluded_occurrence_becomes_a_skipped_run_with_what_the_endpoint_said(api):
    calendar = create_calendar(api, dates=["2026-12-25"])
    created = dt.datetime(2026, 12, 24, 12, tzinfo=UTC)
    from jobs.models import Job as JobModel

    job = cron_job(api, "0 9 * * *", "Europe/Berlin", calendars={"exclude": [calendar["id"]]})
    JobModel.objects.filter(id=job["id"]).update(
        created_at=created, next_run_at=dt.datetime(2026, 12, 25, 8, tzinfo=UTC)
    )
    window = "from=2026-12-25T00:00:00Z&to=2026-12-28T00:00:00Z"
    predicted = api.get(f"/api/v1/jobs/{job['id']}/occurrences/?{window}").json()["results"]
    assert [entry["decision"] for entry in predicted] == ["will_skip", "will_skip", "will_run"]
    assert predicted[0]["reasons"][0].startswith("calendar: 'Bavaria'")
    assert "date 2026-12-25" in predicted[0]["reasons"][0]
    assert "Second Day of Christmas" in predicted[1]["reasons"][0]
    for day in (25, 26, 27):
        scheduler_pass(dt.datetime(2026, 12, day, 8, 0, 1, tzinfo=UTC))
    runs = list(Run.objects.filter(job_id=job["id"]).order_by("scheduled_for"))
    assert [run.skip_reason for run in runs[:2]] == [entry["reasons"][0] for entry in predicted[:2]]
    assert runs[2].state == "queued" and not runs[2].skip_reason
    explained = api.get(f"/api/v1/jobs/{job['id']}/occurrences/?{window}").json()["results"]
    assert [entry["decision"] for entry in explained] == ["skipped", "skipped", "waiting"]
    assert [entry["reasons"] for entry in explained[:2]] == [e["reasons"] for e in predicted[:2]]


def test_editing_a_calendar_touches_only_the_jobs_naming_it(api, user):
    calendar = create_calendar(api)
    other = create_calendar(api, name="other")
    named = cron_job(api, "0 9 * * *", "Europe/Berlin", calendars={"exclude": [calendar["id"]]})
    bystanders = [cron_job(api, "0 9 * * *", "Europe/Berlin",
                           calendars={"only": [other["id"]]}) for _ in range(3)]  # fmt: skip
    bystanders.append(cron_job(api, "0 9 * * *", "Europe/Berlin"))
    before = dict(Job.objects.values_list("id", "updated_at"))
    response = api.patch(f"/api/v1/calendars/{calendar['id']}/", {"dates": ["2027-01-02"]},
                         format="json")  # fmt: skip
    assert response.status_code == 200 and response.json()["version"] == 2
    assert [job["id"] for job in response.json()["jobs"]] == [named["id"]]
    after = dict(Job.objects.values_list("id", "updated_at"))
    assert [str(i) for i in after if after[i] != before[i]] == [named["id"]]
    touched = AuditEvent.objects.filter(action="job.calendar_changed")
    assert [str(event.job_id) for event in touched] == [named["id"]]
    assert JobCalendar.objects.filter(calendar_id=calendar["id"]).count() == 1
    # A live job names it: it stays.
    assert api.delete(f"/api/v1/calendars/{calendar['id']}/").status_code == 409


def test_preview_flags_excluded_instants_with_their_reason(api):
    calendar = create_calendar(
        api, ranges=[{"start": "2025-03-29T00:00", "end": "2025-03-31T00:00", "name": "freeze"}]
    )
    response = api.post(
        "/api/v1/schedules/preview/",
        {"schedule": {"kind": "cron", "expression": "30 2 * * *", "timezone": "Europe/Berlin"},
         "after": "2025-03-28T00:00:00Z", "count": 4,
         "calendars": {"exclude": [calendar["id"]]}},
        format="json",
    )  # fmt: skip
    assert response.status_code == 200, response.json()
    found = response.json()["occurrences"]
    assert [fire["excluded"] for fire in found] == [False, True, True, False]
    assert found[2]["dst"] == "gap_shifted"  # DST first (03:00 CEST), then the calendar
    assert "range 'freeze'" in found[2]["reason"]


def test_a_calendar_edit_keeps_created_runs_and_moves_what_follows(api, user):
    calendar = create_calendar(api, dates=[])
    job = cron_job(api, "0 9 * * *", "Europe/Berlin", calendars={"exclude": [calendar["id"]]})
    Job.objects.filter(id=job["id"]).update(
        created_at=dt.datetime(2026, 6, 1, tzinfo=UTC),
        next_run_at=dt.datetime(2026, 6, 2, 7, tzinfo=UTC),
    )
    scheduler_pass(dt.datetime(2026, 6, 2, 7, 0, 1, tzinfo=UTC))
    stored = Calendar.objects.get(id=calendar["id"])
    spec = {**stored.spec, "dates": ["2026-06-02", "2026-06-03"]}
    assert calendar_update(calendar=stored, name=stored.name, spec=spec,
                           expected_version=1, actor=user,
                           now=dt.datetime(2026, 6, 2, 8, tzinfo=UTC))  # fmt: skip
    # After the edit, the next due time and the prediction at it agree with the decision.
    moved = Job.objects.get(id=job["id"])
    assert moved.next_run_at == dt.datetime(2026, 6, 3, 7, tzinfo=UTC)
    at, now = moved.next_run_at, dt.datetime(2026, 6, 2, 8, tzinfo=UTC)
    page, _ = job_occurrences(job=moved, start=at, end=at + MINUTE, cursor=None, limit=5, now=now)
    assert [entry["decision"] for entry in page] == ["will_skip"]
    scheduler_pass(dt.datetime(2026, 6, 3, 7, 0, 1, tzinfo=UTC))
    states = [state for _, state in scheduled_runs(Job.objects.get(id=job["id"]))]
    assert states == ["queued", "skipped"]  # the run made before the edit kept its decision
    skipped = Run.objects.get(job_id=job["id"], state="skipped")
    assert skipped.skip_reason == page[0]["reasons"][0]


def test_the_admin_edits_a_calendar_and_shows_its_jobs_and_a_jobs_timeline(api, client, user):
    from tests.factories import superuser

    calendar = create_calendar(api, dates=["2026-12-25"])
    job = cron_job(api, "0 9 * * *", "Europe/Berlin", calendars={"exclude": [calendar["id"]]})
    client.force_login(superuser("op"))
    page = client.get(f"/admin/jobs/calendar/{calendar['id']}/change/")
    assert page.status_code == 200 and job["id"] in page.content.decode()
    url = f"/admin/jobs/calendar/{calendar['id']}/change/"
    bad = json.dumps({**BERLIN, "timezone": "Nowhere/X"})
    response = client.post(url, {"name": "Bavaria", "body": bad})
    assert response.status_code == 200 and "timezone" in response.content.decode()
    assert Calendar.objects.get(id=calendar["id"]).version == 1
    response = client.post(
        url, {"name": "Bavaria 2", "body": json.dumps({"dates": ["2026-12-24"]})}
    )
    assert response.status_code == 302
    stored = Calendar.objects.get(id=calendar["id"])
    assert (stored.version, stored.spec["dates"]) == (2, ["2026-12-24"])
    job_page = client.get(f"/admin/jobs/job/{job['id']}/change/").content.decode()
    assert 'id="job-occurrences"' in job_page and "will_run" in job_page


def test_the_occurrences_window_and_cursor_are_validated(api):
    job = cron_job(api, "0 9 * * *", "Europe/Berlin")
    url = f"/api/v1/jobs/{job['id']}/occurrences/"
    backwards = api.get(f"{url}?from=2026-12-02T00:00:00Z&to=2026-12-01T00:00:00Z")
    assert backwards.status_code == 400 and "to" in backwards.json()
    too_long = api.get(f"{url}?from=2026-01-01T00:00:00Z&to=2027-06-01T00:00:00Z")
    assert too_long.status_code == 400 and "to" in too_long.json()
    assert "cursor" in api.get(f"{url}?cursor=nonsense").json()


def test_a_patch_naming_another_owners_calendar_changes_nothing(api, other_user):
    from tests.factories import api_client

    theirs = create_calendar(api_client(other_user))
    job = cron_job(api, "0 9 * * *", "Europe/Berlin")
    response = api.patch(f"/api/v1/jobs/{job['id']}/",
                         {"calendars": {"only": [theirs["id"]]}}, format="json")  # fmt: skip
    assert response.status_code == 400 and "calendars" in response.json()
    stored = Job.objects.get(id=job["id"])
    assert stored.version == 1 and "calendars" not in stored.spec
    assert not JobCalendar.objects.exists()


def test_a_bulk_item_naming_another_owners_calendar_is_refused_by_itself(api, other_user):
    from tests.factories import api_client

    theirs = create_calendar(api_client(other_user))
    mine = create_calendar(api)
    schedule = {"kind": "cron", "expression": "0 9 * * *", "timezone": "Europe/Berlin"}
    body = {"name": "j", "task": "tests.record", "schedule": schedule}
    response = api.post("/api/v1/jobs/bulk/", [
        {**body, "calendars": {"exclude": [mine["id"]]}},
        {**body, "calendars": {"exclude": [theirs["id"]]}},
    ], format="json")  # fmt: skip
    assert response.status_code == 400, response.json()
    assert "calendars" in json.dumps(response.json())
    assert not Job.objects.exists() and not JobCalendar.objects.exists()
