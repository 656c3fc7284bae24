"""The job body (jobs.api.validation): POST /api/v1/jobs/ refuses bad input field by field and
leaves nothing behind. Everything goes through the real API client and database."""

from __future__ import annotations

import copy
import datetime as dt

import pytest

from jobs.models import AuditEvent, Job, JobVersion
from tests.factories import RUN_AT, job_body

JOBS_URL = "/api/v1/jobs/"
OVERSIZE = "x" * (64 * 1024)  # 64 KiB of text is more than 64 KiB as JSON (the quotes)


def without(field: str) -> dict:
    body = job_body()
    del body[field]
    return body


def nested(path: tuple[str, ...], value) -> dict:
    """A valid body with `value` set at `path` (creating intermediate objects)."""
    body = copy.deepcopy(job_body())
    target = body
    for key in path[:-1]:
        target = target.setdefault(key, {})
    target[path[-1]] = value
    return body


def cron_body(**schedule) -> dict:
    return job_body(schedule={"kind": "cron", "expression": "0 9 * * *", **schedule})


def error_at(payload: dict, path: tuple[str, ...]):
    """The error messages under `path` of a 400 body; fails naming the path if absent."""
    found = payload
    for key in path:
        assert isinstance(found, dict) and key in found, f"no error at {path}: {payload}"
        found = found[key]
    assert found, f"empty error at {path}: {payload}"
    return found


def created_counts() -> tuple[int, int, int]:
    """How many jobs, job versions and audit events exist."""
    return Job.objects.count(), JobVersion.objects.count(), AuditEvent.objects.count()


def assert_nothing_created() -> None:
    assert created_counts() == (0, 0, 0)


INVALID_BODIES = {
    # schedule
    "bad cron": (cron_body(expression="61 * * * *"), ("schedule", "expression")),
    "cron with seconds field": (cron_body(expression="0 0 9 * * *"), ("schedule", "expression")),
    "cron gibberish": (cron_body(expression="every day"), ("schedule", "expression")),
    "unknown time zone": (cron_body(timezone="Mars/Olympus_Mons"), ("schedule", "timezone")),
    "cron without expression": (
        job_body(schedule={"kind": "cron", "timezone": "UTC"}),
        ("schedule", "expression"),
    ),
    "unknown kind": (job_body(schedule={"kind": "sometimes"}), ("schedule", "kind")),
    "unparsable run_at": (
        job_body(schedule={"kind": "once", "run_at": "tomorrow"}),
        ("schedule", "run_at"),
    ),
    "run_at without offset": (
        job_body(schedule={"kind": "once", "run_at": "2030-01-01T09:00:00"}),
        ("schedule", "run_at"),
    ),
    "run_at as a number": (
        job_body(schedule={"kind": "once", "run_at": 1893456000}),
        ("schedule", "run_at"),
    ),
    "every_seconds 0": (
        job_body(schedule={"kind": "interval", "every_seconds": 0}),
        ("schedule", "every_seconds"),
    ),
    "every_seconds negative": (
        job_body(schedule={"kind": "interval", "every_seconds": -60}),
        ("schedule", "every_seconds"),
    ),
    "every_seconds as bool": (
        job_body(schedule={"kind": "interval", "every_seconds": True}),
        ("schedule", "every_seconds"),
    ),
    "every_seconds on a once schedule": (
        job_body(schedule={"kind": "once", "run_at": RUN_AT, "every_seconds": 60}),
        ("schedule", "every_seconds"),
    ),
    "run_at on a cron schedule": (cron_body(run_at=RUN_AT), ("schedule", "run_at")),
    "timezone on an interval schedule": (
        job_body(schedule={"kind": "interval", "every_seconds": 60, "timezone": "UTC"}),
        ("schedule", "timezone"),
    ),
    "unknown schedule field": (
        job_body(schedule={"kind": "once", "run_at": RUN_AT, "zone": "UTC"}),
        ("schedule", "zone"),
    ),
    "random cron value": (cron_body(expression="R 9 * * *"), ("schedule", "expression")),
    "cron that only matches DST gaps, gap=skip": (
        job_body(
            schedule={"kind": "cron", "expression": "30 2 * 3 L0", "timezone": "Europe/Berlin"},
            dst={"gap": "skip", "fold": "auto"},
        ),
        ("schedule",),
    ),
    "start_at at the end of time": (
        cron_body(timezone="Europe/Berlin") | {"start_at": "9999-12-31T00:00:00Z"},
        ("schedule",),
    ),
    "end_at before the first occurrence": (
        cron_body() | {"start_at": "2030-01-01T10:00:00Z", "end_at": "2030-01-01T11:00:00Z"},
        ("end_at",),
    ),
    # args and kwargs PostgreSQL could not store
    "NUL character in args": (job_body(args=["a\u0000b"]), ("args",)),
    "NUL character in a kwargs key": (job_body(kwargs={"a\u0000": 1}), ("kwargs",)),
    "args nested too deeply": (
        job_body(args=[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]),
        ("args",),
    ),
    # task
    "unknown task": (job_body(task="os.system"), ("task",)),
    # numbers out of range
    "max_attempts 0": (nested(("retry", "max_attempts"), 0), ("retry", "max_attempts")),
    "max_attempts -1": (nested(("retry", "max_attempts"), -1), ("retry", "max_attempts")),
    "timeout_seconds -5": (job_body(timeout_seconds=-5), ("timeout_seconds",)),
    "jitter_seconds -1": (job_body(jitter_seconds=-1), ("jitter_seconds",)),
    "priority 10": (job_body(priority=10), ("priority",)),
    "initial_delay_seconds negative": (
        nested(("retry", "initial_delay_seconds"), -1),
        ("retry", "initial_delay_seconds"),
    ),
    "backoff_factor below 1": (
        nested(("retry", "backoff_factor"), 0.5),
        ("retry", "backoff_factor"),
    ),
    "grace_seconds negative": (
        nested(("misfire", "grace_seconds"), -1),
        ("misfire", "grace_seconds"),
    ),
    # wrongly typed numbers
    "timeout_seconds as string": (job_body(timeout_seconds="5"), ("timeout_seconds",)),
    "priority as bool": (job_body(priority=True), ("priority",)),
    "jitter_seconds as fraction": (job_body(jitter_seconds=1.5), ("jitter_seconds",)),
    "max_attempts as string": (nested(("retry", "max_attempts"), "3"), ("retry", "max_attempts")),
    "initial_delay_seconds as string": (
        nested(("retry", "initial_delay_seconds"), "10"),
        ("retry", "initial_delay_seconds"),
    ),
    "retry jitter as string": (nested(("retry", "jitter"), "yes"), ("retry", "jitter")),
    # payload size
    "oversize args": (job_body(args=[OVERSIZE]), ("args",)),
    "oversize kwargs": (job_body(kwargs={"blob": OVERSIZE}), ("kwargs",)),
    "args not a list": (job_body(args={"a": 1}), ("args",)),
    # fields
    "unknown top-level field": (job_body(colour="red"), ("colour",)),
    "unknown retry field": (nested(("retry", "max_tries"), 3), ("retry", "max_tries")),
    "missing name": (without("name"), ("name",)),
    "missing task": (without("task"), ("task",)),
    "missing schedule": (without("schedule"), ("schedule",)),
    "blank name": (job_body(name=""), ("name",)),
    "unknown dst policy": (nested(("dst", "gap"), "ignore"), ("dst", "gap")),
    "unknown overlap policy": (job_body(overlap="sometimes"), ("overlap",)),
    # start/end
    "end_at before start_at": (
        job_body(start_at="2030-01-02T00:00:00Z", end_at="2030-01-01T00:00:00Z"),
        ("end_at",),
    ),
    "end_at equal to start_at in another offset": (
        job_body(start_at="2030-01-01T01:00:00+01:00", end_at="2030-01-01T00:00:00Z"),
        ("end_at",),
    ),
    # queue
    "queue with spaces": (job_body(queue="bad queue!"), ("queue",)),
    "empty queue": (job_body(queue=""), ("queue",)),
    "queue outside SCHEDULER_QUEUES": (job_body(queue="amq.gen-x"), ("queue",)),
    "another unconfigured queue": (job_body(queue="billing"), ("queue",)),
}


@pytest.mark.django_db
@pytest.mark.parametrize(("body", "path"), INVALID_BODIES.values(), ids=INVALID_BODIES.keys())
def test_invalid_field_answers_400_naming_it_and_creates_nothing(api, body, path):
    response = api.post(JOBS_URL, body, format="json")
    assert response.status_code == 400, response.content
    error_at(response.json(), path)
    assert_nothing_created()


@pytest.mark.django_db
@pytest.mark.parametrize(
    "field", ["state", "owner", "version", "next_run_at", "id", "created_at", "updated_at"]
)
def test_server_managed_fields_are_refused_as_read_only(api, field):
    """The body cannot set what the server manages; the value is not silently dropped."""
    response = api.post(JOBS_URL, job_body(**{field: "x"}), format="json")
    assert response.status_code == 400
    assert error_at(response.json(), (field,)) == [
        "Read-only: set by the server, not through the API."
    ]
    assert_nothing_created()


@pytest.mark.django_db
@pytest.mark.parametrize(
    "run_at", ["0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-01:00"], ids=["min", "max"]
)
def test_run_at_outside_the_representable_range_is_a_400(api, run_at):
    """An instant that cannot be converted to UTC is bad input, not a server error."""
    api.raise_request_exception = False
    body = job_body(schedule={"kind": "once", "run_at": run_at})
    response = api.post(JOBS_URL, body, format="json")
    assert response.status_code == 400
    error_at(response.json(), ("schedule", "run_at"))
    assert_nothing_created()


@pytest.mark.django_db
def test_cron_that_never_fires_is_a_400(api):
    """`0 0 31 2 *` (February 31st) is syntactically valid but names no instant."""
    api.raise_request_exception = False
    response = api.post(JOBS_URL, cron_body(expression="0 0 31 2 *"), format="json")
    assert response.status_code == 400
    error_at(response.json(), ("schedule", "expression"))
    assert_nothing_created()


@pytest.mark.django_db
def test_valid_body_answers_201_with_every_default_filled(api, user):
    response = api.post(JOBS_URL, job_body(), format="json")
    assert response.status_code == 201, response.content
    job = response.json()
    assert job["retry"] == {
        "max_attempts": 3,
        "initial_delay_seconds": 10,
        "backoff_factor": 2.0,
        "max_delay_seconds": 3600,
        "jitter": True,
    }
    assert job["misfire"] == {"policy": "run_all", "grace_seconds": None}
    assert job["dst"] == {"gap": "shift", "fold": "auto"}
    assert {
        key: job[key]
        for key in (
            "args", "kwargs", "timeout_seconds", "heartbeat_timeout_seconds", "overlap",
            "jitter_seconds", "delivery", "priority", "queue", "labels", "state", "version",
            "owner",
        )
    } == {
        "args": [], "kwargs": {}, "timeout_seconds": 3600, "heartbeat_timeout_seconds": 60,
        "overlap": "allow", "jitter_seconds": 0, "delivery": "at_least_once", "priority": 0,
        "queue": "jobs", "labels": {}, "state": "active", "version": 1,
        "owner": user.get_username(),
    }  # fmt: skip
    assert dt.datetime.fromisoformat(job["next_run_at"]) == dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    assert created_counts() == (1, 1, 1)
    assert Job.objects.get().owner == user


@pytest.mark.django_db
def test_cron_body_is_stored_normalized_with_its_zone(api):
    body = job_body(schedule={"kind": "cron", "expression": "@daily", "timezone": "Asia/Kolkata"})
    response = api.post(JOBS_URL, body, format="json")
    assert response.status_code == 201, response.content
    assert response.json()["schedule"] == {
        "kind": "cron",
        "expression": "0 0 * * *",
        "timezone": "Asia/Kolkata",
    }


def test_every_bad_schedule_field_is_reported_at_once(api):
    """A bad expression and a bad zone in one body: both fields named in one answer."""
    response = api.post(
        "/api/v1/jobs/",
        {
            "name": "x",
            "task": "tests.record",
            "schedule": {"kind": "cron", "expression": "61 * * * *", "timezone": "Mars/Base"},
        },
        format="json",
    )
    assert response.status_code == 400
    assert set(response.json()["schedule"]) == {"expression", "timezone"}
    assert not Job.objects.exists()


def test_a_body_nested_thousands_deep_is_a_client_error(api):
    """Neither the parser nor the size check may blow the stack into a 500."""
    deep = "[" * 3000 + "]" * 3000
    body = (
        f'{{"name": "x", "task": "tests.record", "args": [{deep}], '
        f'"schedule": {{"kind": "once", "run_at": "{RUN_AT}"}}}}'
    )
    response = api.post(JOBS_URL, body, content_type="application/json")
    assert response.status_code == 400, response.content[:300]
    assert_nothing_created()


def test_a_body_over_the_upload_limit_answers_413_in_json(api, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 10_000
    response = api.post(JOBS_URL, job_body(args=["x" * 20_000]), format="json")
    assert response.status_code == 413
    assert "limit" in response.json()["detail"]
    assert_nothing_created()


@pytest.mark.parametrize(
    "schedule, jitter",
    [
        ({"kind": "interval", "every_seconds": 60}, 3600),
        ({"kind": "interval", "every_seconds": 60}, 60),
        ({"kind": "cron", "expression": "*/5 * * * *"}, 300),
        ({"kind": "cron", "expression": "0 9,10 * * *"}, 3600),
    ],
)
def test_a_jitter_as_long_as_the_period_is_refused(api, schedule, jitter):
    r = api.post("/api/v1/jobs/", job_body(schedule=schedule, jitter_seconds=jitter), format="json")
    assert r.status_code == 400, r.json()
    assert "period" in r.json()["jitter_seconds"][0]


@pytest.mark.parametrize(
    "schedule, jitter",
    [
        ({"kind": "interval", "every_seconds": 60}, 59),
        ({"kind": "cron", "expression": "0 9 * * MON-FRI"}, 3600),
        ({"kind": "once", "run_at": "2031-01-01T00:00:00Z"}, 86400),
    ],
)
def test_a_jitter_shorter_than_the_period_is_accepted(api, schedule, jitter):
    r = api.post("/api/v1/jobs/", job_body(schedule=schedule, jitter_seconds=jitter), format="json")
    assert r.status_code == 201, r.json()


def test_a_one_time_job_whose_run_at_is_before_start_at_is_refused(api):
    body = job_body(
        schedule={"kind": "once", "run_at": "2031-01-01T00:00:00Z"}, start_at="2032-01-01T00:00:00Z"
    )
    r = api.post("/api/v1/jobs/", body, format="json")
    assert r.status_code == 400
    assert "run_at" in r.json()["start_at"][0]


def test_a_queue_the_operator_configured_is_accepted(api, settings):
    settings.SCHEDULER_QUEUES = ["jobs", "billing"]
    response = api.post("/api/v1/jobs/", job_body(queue="billing"), format="json")
    assert response.status_code == 201, response.content
    assert response.json()["queue"] == "billing"
    refused = api.post("/api/v1/jobs/", job_body(queue="reports"), format="json")
    assert refused.status_code == 400
    assert "SCHEDULER_QUEUES" in refused.json()["queue"][0]


@pytest.mark.parametrize(
    ("labels", "reason"),
    [
        ({"k" * 64: "v"}, "1-63"),
        ({"k" * 70_000: "v"}, "1-63"),
        ({"a key": "v"}, "letters"),
        ({"": "v"}, "1-63"),
        ({"team": "v" * 201}, "200"),
        ({f"k{i}": "v" for i in range(33)}, "32"),
    ],
)
def test_label_keys_and_values_are_bounded(api, labels, reason):
    response = api.post("/api/v1/jobs/", job_body(labels=labels), format="json")
    assert response.status_code == 400
    assert reason in str(response.json()["labels"])
    assert not Job.objects.exists()


def test_the_whole_job_body_is_bounded_below_its_parts(api, settings):
    half = "x" * (settings.SCHEDULER_MAX_PAYLOAD_BYTES - 100)
    body = job_body(args=[half], kwargs={"k": half})
    response = api.post("/api/v1/jobs/", body, format="json")
    assert response.status_code == 400
    assert "job body" in response.json()["non_field_errors"][0]
    assert api.post("/api/v1/jobs/", job_body(args=[half]), format="json").status_code == 201


def test_an_owner_past_its_job_quota_gets_429_and_nothing_is_written(api, settings):
    settings.SCHEDULER_OWNER_MAX_JOBS = 3
    bulk = [job_body(name=f"j{i}") for i in range(2)]
    assert api.post("/api/v1/jobs/bulk/", bulk, format="json").status_code == 201
    assert api.post("/api/v1/jobs/", job_body(), format="json").status_code == 201
    over = api.post("/api/v1/jobs/", job_body(), format="json")
    assert over.status_code == 429 and "SCHEDULER_OWNER_MAX_JOBS" in over.json()["detail"]
    assert api.post("/api/v1/jobs/bulk/", bulk, format="json").status_code == 429
    assert Job.objects.count() == 3 and JobVersion.objects.count() == 3
    # A cancelled job no longer counts.
    job = Job.objects.first()
    assert api.post(f"/api/v1/jobs/{job.id}/cancel/").status_code == 200
    assert api.post("/api/v1/jobs/", job_body(), format="json").status_code == 201


LEFT_OUT_BODIES = [
    {},
    {"name": "a", "task": "tests.record", "schedule": {"kind": "interval", "every_seconds": 60}},
    {"name": "a", "task": "tests.record", "schedule": {"kind": "cron", "expression": "0 9 * * *"},
     "retry": {"max_attempts": 5}, "labels": {"team": "b"}, "queue": "jobs", "priority": 3},
    {"name": "a", "task": "tests.record", "schedule": {"kind": "interval"}, "overlap": "x"},
    {"name": 5, "task": "nope", "args": "x", "misfire": None, "zzz": 1},
    {"name": "a", "task": "tests.record",
     "schedule": {"kind": "once", "run_at": "2030-06-01T10:00:00Z"}, "dst": {"gap": "skip"},
     "start_at": None, "jitter_seconds": 5, "delivery": "at_most_once"},
]  # fmt: skip


@pytest.mark.parametrize("body", LEFT_OUT_BODIES)
def test_left_out_fields_validate_exactly_as_drf_validates_them(body, monkeypatch):
    """StrictSerializer fills a left-out field with the constant DRF's own pass gives it:
    the same validated data, in the same order, and the same errors, as with every field
    through DRF."""
    from jobs.api import validation

    def validated(fast: bool):
        if not fast:
            monkeypatch.setattr(validation, "_left_out_values", lambda serializer: {})
        serializer = validation.JobSpecSerializer(
            data=copy.deepcopy(body), context={"now": dt.datetime(2030, 1, 1, tzinfo=dt.UTC)}
        )
        valid = serializer.is_valid()
        monkeypatch.undo()
        return valid, list((serializer.validated_data if valid else serializer.errors).items())

    assert validated(fast=True) == validated(fast=False)
