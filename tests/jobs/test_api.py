"""The REST API (jobs.api): reads scoped to the owner, versions and If-Match,
pause/resume/trigger/backfill, soft delete, history, idempotency keys, list filters, the
schedule preview, and a run's cancel and replay (409 in the wrong state, 404 for another
owner, 401 without a token), a job's cancel and a run's history."""

from __future__ import annotations

import datetime as dt
import io

import pytest
from django.core.management import call_command
from drf_spectacular.generators import SchemaGenerator
from rest_framework.test import APIClient

from dispatch.scheduler import SchedulerConfig, scheduler_run_once
from jobs.idempotency import IDEMPOTENCY_RETENTION, idempotency_prune
from jobs.models import (
    AuditEvent,
    IdempotencyRecord,
    Job,
    JobState,
    JobVersion,
    OutboxMessage,
    Run,
    RunKind,
    RunState,
)
from jobs.schedules import BACKFILL_MAX_RUNS
from jobs.transitions import attempt_fail, attempt_succeed
from tests.factories import PINNED_NOW, claim, job_body, later, publish
from tests.factories import api_run_cancel as cancel
from tests.factories import api_run_replay as replay
from tests.factories import run_snapshot as snapshot
from tests.factories import scheduler_pass as run_once
from tests.jobs.test_validation import assert_nothing_created

pytestmark = pytest.mark.django_db
JOBS = "/api/v1/jobs/"
DAILY = {"kind": "cron", "expression": "0 9 * * *", "timezone": "UTC"}


def create(api, **overrides) -> dict:
    response = api.post(JOBS, job_body(**overrides), format="json")
    assert response.status_code == 201, response.content
    return response.json()


def url(job: dict, action: str = "") -> str:
    return f"{JOBS}{job['id']}/{action + '/' if action else ''}"


def patch(api, job: dict, body, version=None):
    headers = {} if version is None else {"HTTP_IF_MATCH": str(version)}
    return api.patch(url(job), body, format="json", **headers)


# --- versions and PATCH -------------------------------------------------------------------


def test_patch_makes_a_new_version_and_recomputes_next_run_at(api):
    job = create(api, schedule=DAILY)
    response = patch(api, job, {"schedule": {**DAILY, "expression": "30 18 * * *"}}, version=1)
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["version"] == 2
    assert response["ETag"] == '"2"'
    assert body["schedule"]["expression"] == "30 18 * * *"
    assert body["next_run_at"].endswith("T18:30:00Z")
    assert list(
        JobVersion.objects.filter(job_id=job["id"])
        .values_list("version", flat=True)
        .order_by("version")
    ) == [1, 2]
    v1 = JobVersion.objects.get(job_id=job["id"], version=1)
    assert v1.spec["schedule"]["expression"] == "0 9 * * *"  # immutable


def test_patch_without_schedule_change_keeps_next_run_at(api):
    job = create(api, schedule=DAILY)
    response = patch(api, job, {"name": "renamed", "labels": {"team": "a"}})
    assert response.status_code == 200
    assert response.json()["next_run_at"] == job["next_run_at"]
    assert response.json()["name"] == "renamed"
    assert Job.objects.get(id=job["id"]).name == "renamed"


def test_runs_already_created_keep_their_version(api, user):
    from jobs.services import job_trigger

    job = create(api, schedule=DAILY)
    run = job_trigger(job=Job.objects.get(id=job["id"]), actor=user, now=dt.datetime.now(dt.UTC))
    assert patch(api, job, {"priority": 5}).status_code == 200
    run.refresh_from_db()
    assert run.job_version.version == 1
    assert api.get(f"/api/v1/runs/{run.id}/").json()["job_version"] == 1


def test_stale_if_match_is_412_and_changes_nothing(api):
    job = create(api, schedule=DAILY)
    assert patch(api, job, {"name": "first"}, version=1).status_code == 200
    response = patch(api, job, {"name": "second"}, version=1)
    assert response.status_code == 412
    assert response.json()["version"] == 2
    assert Job.objects.get(id=job["id"]).name == "first"
    assert JobVersion.objects.filter(job_id=job["id"]).count() == 2


def test_unreadable_if_match_is_400_naming_the_header(api):
    job = create(api)
    response = patch(api, job, {"name": "x"}, version="abc")
    assert response.status_code == 400
    assert "If-Match" in response.json()


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ({"state": "paused"}, "state", "Read-only"),
        ({"version": 9}, "version", "Read-only"),
        ({"owner": "x"}, "owner", "Read-only"),
        ({"next_run_at": "2030-01-01T00:00:00Z"}, "next_run_at", "Read-only"),
        ({"colour": "red"}, "colour", "Unknown field"),
        ({"timeout_seconds": -1}, "timeout_seconds", "greater than or equal to 1"),
        ({"schedule": {"kind": "cron", "expression": "61 * * * *"}}, "schedule", ""),
        ({"overlap": "sometimes"}, "overlap", "not a valid choice"),
    ],
)
def test_bad_patch_is_400_naming_the_field_and_writes_nothing(api, body, field, message):
    job = create(api)
    response = patch(api, job, body, version=1)
    assert response.status_code == 400, response.content
    assert field in response.json()
    assert message in str(response.json()[field])
    assert Job.objects.get(id=job["id"]).version == 1
    assert JobVersion.objects.filter(job_id=job["id"]).count() == 1


def test_patch_of_a_cancelled_job_is_409(api):
    job = create(api)
    assert api.post(url(job, "cancel")).status_code == 200
    response = patch(api, job, {"name": "x"})
    assert response.status_code == 409
    assert response.json()["state"] == "cancelled"


def test_history_lists_versions_with_diffs_and_actions_with_actors(api, user):
    job = create(api, schedule=DAILY)
    patch(api, job, {"name": "renamed", "retry": {"max_attempts": 5}}, version=1)
    api.post(url(job, "pause"))
    api.post(url(job, "resume"))
    history = api.get(url(job, "history")).json()
    assert [v["version"] for v in history["versions"]] == [2, 1]
    changes = {c["field"]: (c["from"], c["to"]) for c in history["versions"][0]["changes"]}
    assert changes == {"name": ("nightly report", "renamed"), "retry.max_attempts": (3, 5)}
    assert history["versions"][0]["created_by"] == user.get_username()
    assert history["versions"][1]["changes"] == []
    actions = [(e["action"], e["actor"]) for e in history["events"]]
    label = f"user:{user.get_username()}"
    assert actions == [
        ("job.resumed", label),
        ("job.paused", label),
        ("job.updated", label),
        ("job.created", label),
    ]


# --- pause, resume, trigger, backfill, delete --------------------------------------------


def test_pause_resume_and_illegal_transitions_answer_409(api):
    job = create(api, schedule=DAILY)
    assert api.post(url(job, "resume")).status_code == 409
    paused = api.post(url(job, "pause"))
    assert (paused.status_code, paused.json()["state"]) == (200, "paused")
    assert api.post(url(job, "pause")).status_code == 409
    assert api.post(url(job, "resume")).json()["state"] == "active"
    api.post(url(job, "cancel"))
    for action in ("pause", "resume", "trigger"):
        response = api.post(url(job, action))
        assert response.status_code == 409, action
        assert response.json()["state"] == "cancelled"
    assert Job.objects.get(id=job["id"]).state == JobState.CANCELLED
    assert not Run.objects.exists()


def test_a_paused_job_can_still_be_triggered_by_hand(api):
    job = create(api, schedule=DAILY)
    api.post(url(job, "pause"))
    response = api.post(url(job, "trigger"))
    assert response.status_code == 201
    assert Job.objects.get(id=job["id"]).state == JobState.PAUSED


def test_trigger_queues_a_manual_run_with_its_outbox_row(api):
    job = create(api, schedule=DAILY)
    response = api.post(url(job, "trigger"))
    assert response.status_code == 201
    run = Run.objects.get(id=response.json()["id"])
    assert (run.kind, run.state, run.job_version.version) == (RunKind.MANUAL, "queued", 1)
    assert OutboxMessage.objects.filter(run=run).count() == 1
    assert AuditEvent.objects.filter(run=run, action="job.triggered").exists()


def test_backfill_creates_one_run_per_occurrence_and_repeating_it_creates_nothing(api):
    job = create(api, schedule={"kind": "cron", "expression": "0 * * * *", "timezone": "UTC"})
    window = {"start": "2025-01-01T00:00:00Z", "end": "2025-01-01T05:00:00Z"}
    first = api.post(url(job, "backfill"), window, format="json")
    assert first.status_code == 201, first.content
    assert (len(first.json()["created"]), first.json()["existing"]) == (5, [])
    runs = Run.objects.filter(job_id=job["id"], kind=RunKind.BACKFILL)
    assert sorted(r.scheduled_for.hour for r in runs) == [0, 1, 2, 3, 4]  # end exclusive
    assert OutboxMessage.objects.count() == 5

    wider = api.post(url(job, "backfill"), {**window, "end": "2025-01-01T06:00:00Z"}, format="json")
    assert (len(wider.json()["created"]), len(wider.json()["existing"])) == (1, 5)
    again = api.post(url(job, "backfill"), window, format="json")
    assert (again.json()["created"], len(again.json()["existing"])) == ([], 5)
    assert Run.objects.filter(job_id=job["id"], kind=RunKind.BACKFILL).count() == 6
    assert OutboxMessage.objects.count() == 6


@pytest.mark.parametrize(
    ("window", "field"),
    [
        ({"start": "2025-01-02T00:00:00Z", "end": "2025-01-01T00:00:00Z"}, "end"),
        ({"start": "2025-01-01T00:00:00Z", "end": "2999-01-01T00:00:00Z"}, "end"),
        ({"start": "2025-01-01T00:00:00"}, "start"),
        ({"start": "2025-01-01T00:00:00Z"}, "end"),
        ({"start": "2025-01-01T00:00:00Z", "end": "2025-01-02T00:00:00Z", "x": 1}, "x"),
    ],
)
def test_bad_backfill_window_is_400_naming_the_field(api, window, field):
    job = create(api, schedule=DAILY)
    response = api.post(url(job, "backfill"), window, format="json")
    assert response.status_code == 400
    assert field in response.json()
    assert not Run.objects.exists()


def test_backfill_beyond_the_bound_is_400_and_creates_nothing(api):
    job = create(api, schedule={"kind": "cron", "expression": "* * * * *", "timezone": "UTC"})
    start = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)
    window = {
        "start": start.isoformat(),
        "end": (start + dt.timedelta(minutes=BACKFILL_MAX_RUNS + 1)).isoformat(),
    }
    response = api.post(url(job, "backfill"), window, format="json")
    assert response.status_code == 400
    assert f"more than {BACKFILL_MAX_RUNS}" in response.json()["end"][0]
    assert not Run.objects.exists()
    exactly = {**window, "end": (start + dt.timedelta(minutes=BACKFILL_MAX_RUNS)).isoformat()}
    assert (
        len(api.post(url(job, "backfill"), exactly, format="json").json()["created"])
        == BACKFILL_MAX_RUNS
    )


def test_delete_cancels_hides_and_keeps_history(api):
    job = create(api, schedule=DAILY)
    trigger = api.post(url(job, "trigger")).json()
    assert api.delete(url(job)).status_code == 204
    assert api.get(url(job)).status_code == 404
    assert api.delete(url(job)).status_code == 404
    assert api.get(JOBS).json()["results"] == []
    stored = Job.objects.get(id=job["id"])
    assert (stored.state, stored.deleted_at is not None) == (JobState.CANCELLED, True)
    assert Run.objects.get(id=trigger["id"]).state == "cancelled"
    actions = set(AuditEvent.objects.filter(job=stored).values_list("action", flat=True))
    assert {"job.created", "job.cancelled", "job.deleted"} <= actions
    assert JobVersion.objects.filter(job=stored).exists()


def test_other_owners_jobs_answer_404_to_every_action(api, make_job, other_user):
    theirs = make_job(owner=other_user, schedule=DAILY)
    job = {"id": str(theirs.id)}
    for action in ("pause", "resume", "trigger", "backfill", "cancel"):
        assert api.post(url(job, action), {}, format="json").status_code == 404, action
    assert api.get(url(job, "history")).status_code == 404
    assert patch(api, job, {"name": "x"}).status_code == 404
    assert api.delete(url(job)).status_code == 404
    theirs.refresh_from_db()
    assert (theirs.state, theirs.version, theirs.deleted_at) == ("active", 1, None)


# --- idempotency keys ----------------------------------------------------------------------


def test_same_key_same_body_returns_the_original_job(api):
    body = job_body()
    first = api.post(JOBS, body, format="json", HTTP_IDEMPOTENCY_KEY="k-1")
    again = api.post(JOBS, body, format="json", HTTP_IDEMPOTENCY_KEY="k-1")
    assert (first.status_code, again.status_code) == (201, 201)
    assert again.json() == first.json()
    assert again["Idempotent-Replayed"] == "true"
    assert Job.objects.count() == 1


def test_a_retry_answers_the_first_answer_where_doing_it_again_would_fail(api, settings):
    """The work is done before its key is recorded (jobs.idempotency); a retry whose work
    would now fail (the owner's quota is full) still answers the first answer."""
    body = job_body()
    first = api.post(JOBS, body, format="json", HTTP_IDEMPOTENCY_KEY="k-q")
    settings.SCHEDULER_OWNER_MAX_JOBS = 1
    assert api.post(JOBS, job_body(name="new"), format="json").status_code == 429
    again = api.post(JOBS, body, format="json", HTTP_IDEMPOTENCY_KEY="k-q")
    assert (again.status_code, again.json()) == (201, first.json())
    assert again["Idempotent-Replayed"] == "true"
    assert Job.objects.count() == 1
    assert IdempotencyRecord.objects.get(key="k-q").response_status == 201


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("headers", "expected"), [
    ({"HTTP_IDEMPOTENCY_KEY": "k-count"}, 6),  # token, throttle, BEGIN, rows, key, COMMIT
    ({}, 5),  # token, throttle, BEGIN, the rows (and their notification), COMMIT
])  # fmt: skip
def test_a_creation_takes_a_pinned_number_of_statements(api, headers, expected):
    """POST /jobs/ in its own transactions, as in production: the statements of one
    creation are counted so that a round trip added to the hot path is a decision (the
    clock is the throttle's reading; the operators' group is read only for a spec naming
    upstreams; no savepoint without a managed-by label; the notification rides in the
    insert)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    create(api, name="first")  # the owner's quota count, reused for a second
    with CaptureQueriesContext(connection) as statements:
        response = api.post(JOBS, job_body(), format="json", **headers)
    assert response.status_code == 201
    shown = [statement["sql"][:60] for statement in statements.captured_queries]
    assert len(shown) == expected, shown
    assert Job.objects.filter(name="nightly report").count() == 1


def test_same_key_other_body_is_409_and_creates_nothing(api):
    api.post(JOBS, job_body(), format="json", HTTP_IDEMPOTENCY_KEY="k-1")
    response = api.post(JOBS, job_body(name="other"), format="json", HTTP_IDEMPOTENCY_KEY="k-1")
    assert response.status_code == 409
    assert "Idempotency-Key" in response.json()["detail"]
    assert Job.objects.count() == 1


def test_keys_are_per_owner_and_per_operation(api, user, other_user):
    from tests.factories import api_client

    other = api_client(other_user)
    mine = api.post(JOBS, job_body(), format="json", HTTP_IDEMPOTENCY_KEY="shared").json()
    theirs = other.post(JOBS, job_body(), format="json", HTTP_IDEMPOTENCY_KEY="shared").json()
    assert mine["id"] != theirs["id"]
    trigger = api.post(url(mine, "trigger"), format="json", HTTP_IDEMPOTENCY_KEY="shared")
    assert trigger.status_code == 201


def test_a_failed_request_does_not_burn_its_key(api):
    bad = api.post(JOBS, job_body(timeout_seconds=-1), format="json", HTTP_IDEMPOTENCY_KEY="k")
    assert bad.status_code == 400
    assert_nothing_created()
    assert not IdempotencyRecord.objects.exists()
    assert api.post(JOBS, job_body(), format="json", HTTP_IDEMPOTENCY_KEY="k").status_code == 201


def test_trigger_replay_returns_the_same_run(api):
    job = create(api, schedule=DAILY)
    first = api.post(url(job, "trigger"), HTTP_IDEMPOTENCY_KEY="t-1")
    again = api.post(url(job, "trigger"), HTTP_IDEMPOTENCY_KEY="t-1")
    assert first.json()["id"] == again.json()["id"]
    assert Run.objects.count() == OutboxMessage.objects.count() == 1


def test_backfill_replay_returns_the_same_answer_and_other_window_conflicts(api):
    job = create(api, schedule={"kind": "cron", "expression": "0 * * * *", "timezone": "UTC"})
    window = {"start": "2025-01-01T00:00:00Z", "end": "2025-01-01T03:00:00Z"}
    first = api.post(url(job, "backfill"), window, format="json", HTTP_IDEMPOTENCY_KEY="b")
    again = api.post(url(job, "backfill"), window, format="json", HTTP_IDEMPOTENCY_KEY="b")
    assert again.json() == first.json()  # the original answer, not "existing: 3"
    other = {**window, "end": "2025-01-01T04:00:00Z"}
    assert (
        api.post(url(job, "backfill"), other, format="json", HTTP_IDEMPOTENCY_KEY="b").status_code
        == 409
    )
    assert Run.objects.count() == 3


@pytest.mark.parametrize("key", ["", "x" * 201, "tab\there"])
def test_a_malformed_key_is_400_naming_the_header(api, key):
    response = api.post(JOBS, job_body(), format="json", HTTP_IDEMPOTENCY_KEY=key)
    assert response.status_code == 400
    assert "Idempotency-Key" in response.json()
    assert_nothing_created()


def test_an_expired_key_is_forgotten_and_pruned_in_bounded_batches(api, user):
    first = api.post(JOBS, job_body(), format="json", HTTP_IDEMPOTENCY_KEY="old").json()
    old = dt.datetime.now(dt.UTC) - IDEMPOTENCY_RETENTION - dt.timedelta(minutes=1)
    IdempotencyRecord.objects.update(created_at=old)
    second = api.post(JOBS, job_body(), format="json", HTTP_IDEMPOTENCY_KEY="old").json()
    assert second["id"] != first["id"]  # past retention, the key is new again
    for index in range(3):
        IdempotencyRecord.objects.create(
            owner=user, scope="jobs.create", key=f"p{index}", request_hash="h",
            response_status=201, response_body={}, created_at=old,
        )  # fmt: skip
    now = dt.datetime.now(dt.UTC)
    assert idempotency_prune(now=now, limit=2) == 2
    assert idempotency_prune(now=now, limit=2) == 1
    assert IdempotencyRecord.objects.filter(key="old").count() == 1  # the live one stays


# --- lists ---------------------------------------------------------------------------------


def test_job_filters_by_label_state_task_and_created_range(api, make_job, user):
    early = make_job(now=dt.datetime(2025, 1, 1, tzinfo=dt.UTC), labels={"team": "billing"})
    late = make_job(
        now=dt.datetime(2025, 6, 1, tzinfo=dt.UTC), labels={"team": "search", "a__b": "c:d"}
    )
    Job.objects.filter(id=late.id).update(state="paused")

    def ids(query: str) -> set[str]:
        response = api.get(f"{JOBS}?{query}")
        assert response.status_code == 200, response.content
        return {job["id"] for job in response.json()["results"]}

    assert ids("label=team:billing") == {str(early.id)}
    assert ids("label=team:nobody") == set()
    assert ids("label=a__b:c:d") == {str(late.id)}  # a key is a key; the value may hold ":"
    assert ids("state=paused") == {str(late.id)}
    assert ids("task=tests.record") == {str(early.id), str(late.id)}
    assert ids("created_after=2025-03-01T00:00:00Z") == {str(late.id)}
    assert ids("created_before=2025-03-01T00:00:00Z") == {str(early.id)}
    assert api.get(f"{JOBS}?label=nocolon").status_code == 400
    assert api.get(f"{JOBS}?created_after=yesterday").status_code == 400


def test_job_list_ordering_and_cursor_pages(api, make_job):
    for index, name in enumerate(["c", "a", "b"]):
        make_job(now=dt.datetime(2025, 1, 1 + index, tzinfo=dt.UTC), name=name)
    names = [j["name"] for j in api.get(f"{JOBS}?ordering=name").json()["results"]]
    assert names == ["a", "b", "c"]
    newest = [j["name"] for j in api.get(JOBS).json()["results"]]
    assert newest == ["b", "a", "c"]
    page = api.get(f"{JOBS}?ordering=created_at&page_size=2").json()
    assert [j["name"] for j in page["results"]] == ["c", "a"]
    rest = api.get(page["next"]).json()
    assert [j["name"] for j in rest["results"]] == ["b"]
    assert api.get(f"{JOBS}?ordering=owner").status_code == 400


def test_run_filters_and_ordering(api):
    job = create(api, schedule={"kind": "cron", "expression": "0 * * * *", "timezone": "UTC"})
    api.post(
        url(job, "backfill"),
        {"start": "2025-01-01T00:00:00Z", "end": "2025-01-01T03:00:00Z"},
        format="json",
    )
    api.post(url(job, "trigger"))
    runs = "/api/v1/runs/"
    assert len(api.get(f"{runs}?kind=backfill").json()["results"]) == 3
    assert len(api.get(f"{runs}?kind=manual").json()["results"]) == 1
    hours = [
        r["scheduled_for"][11:13]
        for r in api.get(f"{runs}?kind=backfill&ordering=scheduled_for").json()["results"]
    ]
    assert hours == ["00", "01", "02"]
    window = "scheduled_after=2025-01-01T01:00:00Z&scheduled_before=2025-01-01T02:00:00Z"
    assert len(api.get(f"{runs}?{window}").json()["results"]) == 1
    assert len(api.get(f"{url(job, 'runs')}?state=queued").json()["results"]) == 4


# --- schedule preview ----------------------------------------------------------------------

PREVIEW = "/api/v1/schedules/preview/"


def test_preview_flags_a_gap_shift_in_new_york(api):
    body = {
        "schedule": {"kind": "cron", "expression": "30 2 * * *", "timezone": "America/New_York"},
        "after": "2025-03-08T12:00:00Z",
        "count": 2,
    }
    response = api.post(PREVIEW, body, format="json")
    assert response.status_code == 200, response.content
    assert response.json()["occurrences"] == [
        {
            "at": "2025-03-09T07:00:00Z",
            "local": "2025-03-09T03:00:00-04:00",
            "dst": "gap_shifted",
            "doubled": False,
        },
        {
            "at": "2025-03-10T06:30:00Z",
            "local": "2025-03-10T02:30:00-04:00",
            "dst": "",
            "doubled": False,
        },
    ]


def test_preview_flags_both_instants_of_a_doubled_fold(api):
    body = {
        "schedule": {"kind": "cron", "expression": "30 1 * * *", "timezone": "America/New_York"},
        "dst": {"fold": "both"},
        "after": "2025-11-01T12:00:00Z",
        "count": 2,
    }
    occurrences = api.post(PREVIEW, body, format="json").json()["occurrences"]
    assert [(o["at"], o["dst"], o["doubled"]) for o in occurrences] == [
        ("2025-11-02T05:30:00Z", "fold_first", True),
        ("2025-11-02T06:30:00Z", "fold_second", True),
    ]
    first_only = api.post(PREVIEW, {**body, "dst": {"fold": "first"}}, format="json").json()
    assert [(o["dst"], o["doubled"]) for o in first_only["occurrences"]] == [
        ("fold_first", False),
        ("", False),
    ]


def test_preview_defaults_after_to_now_and_bounds_count(api):
    body = {"schedule": {"kind": "interval", "every_seconds": 60}}
    occurrences = api.post(PREVIEW, body, format="json").json()["occurrences"]
    assert len(occurrences) == 10
    assert api.post(PREVIEW, {**body, "count": 101}, format="json").status_code == 400
    assert api.post(PREVIEW, {**body, "count": 0}, format="json").status_code == 400


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"schedule": {"kind": "cron", "expression": "0 0 31 2 *"}}, "schedule"),
        (
            {"schedule": {"kind": "cron", "expression": "0 9 * * *", "timezone": "Mars/Base"}},
            "schedule",
        ),
        ({"schedule": {"kind": "interval", "every_seconds": 60}, "dst": {"gap": "maybe"}}, "dst"),
        ({"schedule": {"kind": "interval", "every_seconds": 60}, "after": "now"}, "after"),
        ({}, "schedule"),
    ],
)
def test_bad_preview_is_400_naming_the_field(api, body, field):
    response = api.post(PREVIEW, body, format="json")
    assert response.status_code == 400
    assert field in response.json()


T0 = dt.datetime(2030, 1, 1, 0, 0, tzinfo=dt.UTC)
H = dt.timedelta(hours=1)
HOURLY = {"kind": "cron", "expression": "0 * * * *", "timezone": "UTC"}


def test_the_api_shows_a_skipped_runs_reason(api, make_job):
    job = make_job(now=T0 - dt.timedelta(minutes=30), schedule=HOURLY, misfire={"policy": "skip"})
    run_once(T0 + 3 * H)
    run = Run.objects.filter(job=job, state=RunState.SKIPPED).first()
    body = api.get(f"/api/v1/runs/{run.id}/").json()
    assert body["skip_reason"].startswith("misfire: missed by")
    listed = api.get(f"/api/v1/jobs/{job.id}/runs/").json()["results"]
    skipped = Run.objects.filter(job=job, state=RunState.SKIPPED)
    assert {item["skip_reason"] for item in listed if item["state"] == "skipped"} == {
        run.skip_reason for run in skipped
    }


def test_a_backfill_from_year_one_is_a_400_on_start(api):
    job = api.post(
        "/api/v1/jobs/", job_body(schedule={"kind": "cron", "expression": "0 0 1 1 *"}),
        format="json",
    ).json()  # fmt: skip
    r = api.post(
        f"/api/v1/jobs/{job['id']}/backfill/",
        {"start": "0001-01-01T00:00:00Z", "end": "0001-01-02T00:00:00Z"},
        format="json",
    )
    assert r.status_code == 400
    assert "cannot be evaluated" in r.json()["start"][0]


def test_an_interval_backfill_before_the_jobs_creation_extends_its_grid_backwards(api):
    job = api.post(
        "/api/v1/jobs/", job_body(schedule={"kind": "interval", "every_seconds": 3600}),
        format="json",
    ).json()  # fmt: skip
    created_at = dt.datetime.fromisoformat(job["created_at"])
    start, end = created_at - dt.timedelta(days=1), created_at - dt.timedelta(minutes=1)
    r = api.post(
        f"/api/v1/jobs/{job['id']}/backfill/",
        {"start": start.isoformat(), "end": end.isoformat()},
        format="json",
    )
    assert r.status_code == 201
    runs = Run.objects.filter(id__in=r.json()["created"])
    assert len(runs) == 24
    # On the job's own grid: a whole number of periods before its creation.
    assert {(created_at - run.scheduled_for) % dt.timedelta(hours=1) for run in runs} == {
        dt.timedelta(0)
    }


@pytest.mark.parametrize("body", [{}, {"name": "nightly report"}])
def test_a_patch_that_changes_nothing_makes_no_version(api, body):
    job = api.post("/api/v1/jobs/", job_body(), format="json").json()
    r = api.patch(f"/api/v1/jobs/{job['id']}/", body, format="json", HTTP_IF_MATCH="1")
    assert r.status_code == 200
    assert r.json()["version"] == 1
    assert JobVersion.objects.filter(job_id=job["id"]).count() == 1
    assert not AuditEvent.objects.filter(job_id=job["id"], action="job.updated").exists()


def test_a_patch_of_a_cancelled_job_is_409_whatever_the_body(api):
    job = api.post("/api/v1/jobs/", job_body(), format="json").json()
    api.post(f"/api/v1/jobs/{job['id']}/cancel/")
    r = api.patch(f"/api/v1/jobs/{job['id']}/", {"timeout_seconds": -1}, format="json")
    assert r.status_code == 409
    assert r.json()["state"] == "cancelled"


def test_openapi_schema_generates_and_validates_without_warnings(db):
    out = io.StringIO()
    call_command("spectacular", "--validate", "--fail-on-warn", stdout=out)
    schema = out.getvalue()
    for path in (
        "/api/v1/jobs/",
        "/api/v1/jobs/{job_id}/",
        "/api/v1/runs/",
        "/api/v1/runs/{run_id}/",
    ):
        assert f"{path}:" in schema


def test_the_job_run_list_schema_has_no_job_filter():
    schema = SchemaGenerator().get_schema(request=None, public=True)
    job_runs = [
        p["name"] for p in schema["paths"]["/api/v1/jobs/{job_id}/runs/"]["get"]["parameters"]
    ]
    all_runs = [p["name"] for p in schema["paths"]["/api/v1/runs/"]["get"]["parameters"]]
    assert "job" not in job_runs and "state" in job_runs
    assert "job" in all_runs


@pytest.mark.django_db
def test_unauthenticated_request_answers_401():
    response = APIClient().post(JOBS, job_body(), format="json")
    assert response.status_code == 401
    assert APIClient().get(JOBS).status_code == 401
    assert_nothing_created()


@pytest.mark.django_db
def test_another_users_job_answers_404(api, make_job, other_user):
    theirs = make_job(owner=other_user)
    assert api.get(f"{JOBS}{theirs.id}/").status_code == 404
    assert api.get(f"{JOBS}{theirs.id}/runs/").status_code == 404
    assert api.get(JOBS).json()["results"] == []


@pytest.mark.django_db
def test_own_job_is_visible(api, make_job):
    """The counterpart of the 404 above: the same request for one's own job answers 200."""
    mine = make_job()
    response = api.get(f"{JOBS}{mine.id}/")
    assert response.status_code == 200
    assert response.json()["id"] == str(mine.id)


@pytest.mark.django_db
def test_another_users_runs_are_not_listed(api, make_job, other_user):
    make_job(owner=other_user, now=dt.datetime(2029, 12, 31, tzinfo=dt.UTC))
    scheduler_run_once(
        now=dt.datetime(2030, 1, 1, 0, 0, 1, tzinfo=dt.UTC), config=SchedulerConfig()
    )
    their_run = Run.objects.get()
    assert api.get("/api/v1/runs/").json()["results"] == []
    assert api.get(f"/api/v1/runs/{their_run.id}/").status_code == 404


@pytest.mark.django_db
def test_schema_is_served_to_an_authenticated_user(api):
    response = api.get("/api/schema/")
    assert response.status_code == 200
    assert b"/api/v1/jobs/" in response.content


# --- a run's cancel and replay, a job's cancel, a run's history ------------------------

NOW = PINNED_NOW


def _succeeded(run: Run) -> None:
    assert attempt_succeed(attempt=claim(run), now=later(1))


def _failed(run: Run) -> None:
    assert attempt_fail(attempt=claim(run), now=later(1), error="boom", retry_at=None)


def _skipped(run: Run) -> None:
    Run.objects.filter(id=run.id).update(state=RunState.SKIPPED, finished_at=later(1))


@pytest.mark.parametrize(
    ("finish", "state"),
    [
        (_succeeded, RunState.SUCCEEDED),
        (_failed, RunState.FAILED),
        (_skipped, RunState.SKIPPED),
    ],
    ids=["succeeded", "failed", "skipped"],
)
def test_cancel_of_a_finished_run_is_a_conflict_and_changes_nothing(api, queued_run, finish, state):
    run = queued_run()
    publish(run)
    finish(run)
    before = snapshot(run.id)

    response = cancel(api, run)

    assert response.status_code == 409
    body = response.json()
    assert body["state"] == state
    assert state in body["detail"]
    assert snapshot(run.id) == before
    assert not AuditEvent.objects.filter(run=run).exists()


def _running(run: Run) -> None:
    claim(run)


@pytest.mark.parametrize(
    ("prepare", "state"),
    [
        (lambda run: None, RunState.QUEUED),
        (_running, RunState.RUNNING),
        (_succeeded, RunState.SUCCEEDED),
    ],
    ids=["queued", "running", "succeeded"],
)
def test_replay_of_a_run_that_did_not_fail_is_a_conflict_and_changes_nothing(
    api, queued_run, prepare, state
):
    run = queued_run()
    prepare(run)
    before = snapshot(run.id)

    response = replay(api, run)

    assert response.status_code == 409
    assert response.json()["state"] == state
    assert state in response.json()["detail"]
    assert snapshot(run.id) == before
    assert not AuditEvent.objects.filter(run=run).exists()


@pytest.mark.parametrize("action", [cancel, replay], ids=["cancel", "replay"])
def test_another_owners_run_is_not_found_and_unchanged(api, other_user, queued_run, action):
    run = queued_run(owner=other_user)
    _failed(run)  # replayable, so only ownership can refuse it
    before = snapshot(run.id)

    assert action(api, run).status_code == 404
    assert snapshot(run.id) == before
    assert not AuditEvent.objects.filter(run=run).exists()


@pytest.mark.parametrize("action", [cancel, replay], ids=["cancel", "replay"])
def test_an_unauthenticated_request_is_refused(queued_run, action):
    run = queued_run()
    _failed(run)
    before = snapshot(run.id)

    assert action(APIClient(), run).status_code == 401
    assert snapshot(run.id) == before


def test_job_cancel_cancels_the_job_and_every_active_run(api, user, make_job):
    job = make_job(now=NOW, schedule={"kind": "interval", "every_seconds": 300})
    assert scheduler_run_once(now=NOW, config=SchedulerConfig()).runs_created == 1
    waiting = Run.objects.get(job=job)
    publish(waiting)
    assert attempt_fail(attempt=claim(waiting), now=later(1), error="boom", retry_at=later(600))
    assert scheduler_run_once(now=later(300), config=SchedulerConfig()).runs_created == 1
    queued = Run.objects.get(job=job, state=RunState.QUEUED)
    job.refresh_from_db()
    assert job.next_run_at == later(600)

    response = api.post(f"/api/v1/jobs/{job.id}/cancel/")

    assert response.status_code == 200, response.content
    assert (response.json()["state"], response.json()["next_run_at"]) == (JobState.CANCELLED, None)
    job.refresh_from_db()
    assert (job.state, job.next_run_at) == (JobState.CANCELLED, None)
    waiting.refresh_from_db()
    queued.refresh_from_db()
    assert (waiting.state, waiting.next_attempt_at) == (RunState.CANCELLED, None)
    assert queued.state == RunState.CANCELLED
    assert not OutboxMessage.objects.filter(run=queued).exists()
    assert AuditEvent.objects.filter(job=job, action="job.cancelled", actor=user).count() == 1
    assert set(
        AuditEvent.objects.filter(action="run.cancelled").values_list("run_id", flat=True)
    ) == {waiting.id, queued.id}
    # No more runs: neither the schedule nor the retry brings one.
    scheduler_run_once(now=later(3600), config=SchedulerConfig())
    assert Run.objects.filter(job=job).exclude(state=RunState.CANCELLED).count() == 0
    audit_count = AuditEvent.objects.count()

    again = api.post(f"/api/v1/jobs/{job.id}/cancel/")

    assert again.status_code == 409
    assert again.json()["state"] == JobState.CANCELLED
    assert AuditEvent.objects.count() == audit_count
    assert Job.objects.get(id=job.id).state == JobState.CANCELLED


def test_run_detail_shows_the_runs_history_with_its_actors(api, queued_run, user):
    run = queued_run()
    publish(run)
    assert api.post(f"/api/v1/runs/{run.id}/cancel/").status_code == 200
    assert api.post(f"/api/v1/runs/{run.id}/replay/").status_code == 200

    history = api.get(f"/api/v1/runs/{run.id}/").json()["history"]
    assert [(e["action"], e["actor"]) for e in history] == [
        ("run.cancelled", f"user:{user.username}"),
        ("run.replayed", f"user:{user.username}"),
    ]
    assert history[1]["data"]["from_state"] == "cancelled"
