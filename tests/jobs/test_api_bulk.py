"""POST /api/v1/jobs/bulk/: many jobs in one transaction, all or none, errors aligned with
the items, per-item idempotency keys shared with POST /jobs/'s Idempotency-Key."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from django.db import connection, transaction
from django.utils import timezone

from jobs.idempotency import IDEMPOTENCY_RETENTION
from jobs.models import AuditEvent, IdempotencyRecord, Job, JobVersion
from tests.factories import api_client, job_body
from tests.jobs.test_races import in_threads
from tests.jobs.test_validation import assert_nothing_created
from tests.threads import wait_for_lock_waiters

BULK = "/api/v1/jobs/bulk/"
DAILY = {"kind": "cron", "expression": "0 9 * * *", "timezone": "UTC"}


def bulk(api, items):
    return api.post(BULK, items, format="json")


@pytest.mark.django_db
def test_creates_every_job_with_its_version_and_audit_event_in_order(api, user):
    items = [job_body(name=f"job {i}", schedule=DAILY) for i in range(5)]
    response = bulk(api, items)
    assert response.status_code == 201, response.content
    body = response.json()
    assert [job["name"] for job in body["jobs"]] == [f"job {i}" for i in range(5)]
    assert body["replayed"] == [False] * 5
    ids = {job["id"] for job in body["jobs"]}
    assert set(map(str, Job.objects.filter(owner=user).values_list("id", flat=True))) == ids
    assert JobVersion.objects.filter(version=1).count() == 5
    assert AuditEvent.objects.filter(action="job.created").count() == 5
    first = body["jobs"][0]
    assert first["owner"] == user.get_username() and first["state"] == "active"
    # What was stored is what was answered.
    for job in body["jobs"]:
        assert api.get(f"/api/v1/jobs/{job['id']}/").json() == job
    version = JobVersion.objects.get(job_id=first["id"])
    assert version.spec == Job.objects.get(id=first["id"]).spec and version.created_by == user
    event = AuditEvent.objects.get(job_id=first["id"])
    assert (event.actor, event.actor_label, event.data) == (
        user, f"user:{user.get_username()}", {"version": 1, "bulk": True})  # fmt: skip
    assert event.created_at is not None and version.created_at is not None
    assert first["next_run_at"].endswith("T09:00:00Z")
    # The same body as POST /jobs/ answers, defaults included.
    single = api.post("/api/v1/jobs/", items[0], format="json").json()
    assert {k: v for k, v in single.items() if k not in ("id", "created_at", "updated_at",
            "next_run_at")} == {k: v for k, v in first.items() if k not in ("id",
            "created_at", "updated_at", "next_run_at")}  # fmt: skip


@pytest.mark.django_db
def test_one_invalid_item_refuses_all_with_errors_aligned(api):
    items = [job_body(), job_body(schedule={"kind": "cron", "expression": "61 * * * *"}),
             job_body(), job_body(timeout_seconds=-1)]  # fmt: skip
    response = bulk(api, items)
    assert response.status_code == 400
    errors = response.json()["errors"]
    assert len(errors) == 4 and errors[0] is None and errors[2] is None
    assert "expression" in errors[1]["schedule"]
    assert "timeout_seconds" in errors[3]
    assert_nothing_created()
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    "body", [{"jobs": []}, "text", [1], [job_body(owner="x")], [job_body(), {"name": "n"}]]
)
def test_a_body_that_is_not_a_list_of_job_bodies_is_400(api, body):
    response = bulk(api, body)
    assert response.status_code == 400, response.content
    assert_nothing_created()


@pytest.mark.django_db
def test_more_than_1000_items_is_400_and_1000_are_created(api):
    response = bulk(api, [job_body()] * 1001)
    assert response.status_code == 400
    assert "1000" in str(response.json())
    assert_nothing_created()
    response = bulk(api, [job_body(name=f"n{i}") for i in range(1000)])
    assert response.status_code == 201
    assert Job.objects.count() == JobVersion.objects.count() == 1000


@pytest.mark.django_db
def test_an_empty_list_creates_nothing(api):
    response = bulk(api, [])
    assert response.status_code == 201
    assert response.json() == {"jobs": [], "replayed": []}


@pytest.mark.django_db
def test_same_keys_and_bodies_replay_the_same_jobs(api):
    items = [{**job_body(name="a"), "idempotency_key": "a"}, job_body(name="plain")]
    first = bulk(api, items).json()
    items.append({**job_body(name="c"), "idempotency_key": "c"})
    again = bulk(api, items)
    assert again.status_code == 201
    body = again.json()
    assert body["replayed"] == [True, False, False]
    assert body["jobs"][0] == first["jobs"][0]
    assert body["jobs"][1]["id"] != first["jobs"][1]["id"]  # no key: a new job
    assert Job.objects.count() == 4
    assert IdempotencyRecord.objects.count() == 2


@pytest.mark.django_db
def test_a_key_with_another_body_is_409_for_that_item_and_creates_nothing(api):
    bulk(api, [{**job_body(), "idempotency_key": "k"}])
    response = bulk(api, [job_body(), {**job_body(name="other"), "idempotency_key": "k"}])
    assert response.status_code == 409
    errors = response.json()["errors"]
    assert errors[0] is None and "idempotency_key" in errors[1]
    assert Job.objects.count() == 1


@pytest.mark.django_db
def test_keys_are_shared_with_post_jobs_idempotency_key(api):
    single = api.post("/api/v1/jobs/", job_body(), format="json", HTTP_IDEMPOTENCY_KEY="s")
    response = bulk(api, [{**job_body(), "idempotency_key": "s"}])
    assert response.json()["jobs"][0] == single.json()
    assert response.json()["replayed"] == [True]
    created = bulk(api, [{**job_body(name="b"), "idempotency_key": "b"}]).json()["jobs"][0]
    again = api.post("/api/v1/jobs/", job_body(name="b"), format="json", HTTP_IDEMPOTENCY_KEY="b")
    assert again.json() == created and again["Idempotent-Replayed"] == "true"
    assert Job.objects.count() == 2


@pytest.mark.django_db
@pytest.mark.parametrize("keys", [["x", "x"], [5, None], ["", None], ["tab\there", None]])
def test_a_repeated_or_malformed_key_is_400_on_that_item(api, keys):
    items = [{**job_body(), **({"idempotency_key": k} if k is not None else {})} for k in keys]
    response = bulk(api, items)
    assert response.status_code == 400
    errors = response.json()["errors"]
    assert "idempotency_key" in errors[-1 if keys[0] == keys[1] else 0]
    assert_nothing_created()


@pytest.mark.django_db
def test_keys_are_per_owner_and_an_expired_key_is_new_again(api, other_user):
    mine = bulk(api, [{**job_body(), "idempotency_key": "k"}]).json()["jobs"][0]
    theirs = bulk(api_client(other_user), [{**job_body(), "idempotency_key": "k"}]).json()
    assert theirs["replayed"] == [False] and theirs["jobs"][0]["id"] != mine["id"]
    IdempotencyRecord.objects.update(
        created_at=timezone.now() - IDEMPOTENCY_RETENTION - dt.timedelta(minutes=1)
    )
    again = bulk(api, [{**job_body(), "idempotency_key": "k"}]).json()
    assert again["replayed"] == [False] and again["jobs"][0]["id"] != mine["id"]
    assert IdempotencyRecord.objects.count() == 2


@pytest.mark.django_db
def test_an_invalid_item_whose_key_replays_is_answered_from_its_record(api, monkeypatch):
    first = bulk(api, [{**job_body(), "idempotency_key": "k"}]).json()["jobs"][0]
    # The body is valid no more (its task is gone), but it was accepted with this key.
    monkeypatch.setattr("jobs.api.validation.registered_task_names", frozenset)
    assert bulk(api, [job_body()]).status_code == 400
    response = bulk(api, [{**job_body(), "idempotency_key": "k"}])
    assert response.status_code == 201
    assert response.json()["jobs"][0] == first


@pytest.mark.django_db(transaction=True)
def test_two_concurrent_bulks_sharing_keys_make_each_job_once(user):
    items = [{**job_body(name=f"n{i}"), "idempotency_key": f"k{i}"} for i in range(20)]

    def post(order):
        return lambda: api_client(user).post(BULK, order, format="json")

    with transaction.atomic():
        # A holder of one key: both requests block on the unique index behind it.
        IdempotencyRecord.objects.create(owner=user, scope="jobs.create", key="k5",
                                         request_hash="-", response_status=0,
                                         response_body={}, created_at=timezone.now())  # fmt: skip
        threads, responses = in_threads(post(items), post(items[::-1]))
        wait_for_lock_waiters(2)
        transaction.set_rollback(True)
    for thread in threads:
        thread.join(30)

    assert [r.status_code for r in responses] == [201, 201], [r.content for r in responses]
    first, second = (r.json() for r in responses)
    assert first["jobs"] == second["jobs"][::-1]
    assert sorted(first["replayed"] + second["replayed"]) == [False] * 20 + [True] * 20
    assert Job.objects.count() == 20 and IdempotencyRecord.objects.count() == 20
    connection.close()


def test_the_schema_describes_the_bulk_endpoint():
    from drf_spectacular.generators import SchemaGenerator

    schema = SchemaGenerator().get_schema(request=None, public=True)
    operation = schema["paths"]["/api/v1/jobs/bulk/"]["post"]
    assert set(operation["responses"]) >= {"201", "400", "409"}
    body = operation["requestBody"]["content"]["application/json"]["schema"]
    assert body["type"] == "array"


@pytest.mark.django_db
def test_post_jobs_errors_are_the_serializers_own(api):
    """POST /jobs/ validates with a reused serializer: the answers are is_valid's."""
    from jobs.api.validation import JobSpecSerializer

    for body in (None, [], "x", {}, job_body(schedule={"kind": "cron"}), job_body(x=1)):
        response = api.post("/api/v1/jobs/", json.dumps(body), content_type="application/json")
        serializer = JobSpecSerializer(data=body)
        assert not serializer.is_valid()
        assert (response.status_code, response.json()) == (400, serializer.errors), body
