"""Concurrent requests on one job, from two threads with their own connections: two PATCHes
of one version (one wins, one 412) and two creations with one Idempotency-Key (one job).

The main thread holds a lock the requests need until both are waiting on it, so the race is
the one under test every time, not whichever order the threads happen to run in."""

from __future__ import annotations

import threading

import pytest
from django.db import connection, connections, transaction
from django.utils import timezone

from jobs.models import IdempotencyRecord, Job, JobVersion
from tests.factories import api_client, job_body
from tests.threads import wait_for_lock_waiters

pytestmark = pytest.mark.django_db(transaction=True)


def in_threads(*requests) -> list:
    """Run each request in its own thread (and database connection); their responses."""
    responses: list = [None] * len(requests)

    def call(index, request):
        try:
            responses[index] = request()
        finally:
            connections.close_all()

    threads = [threading.Thread(target=call, args=(i, r)) for i, r in enumerate(requests)]
    for thread in threads:
        thread.start()
    return threads, responses


def test_two_concurrent_patches_of_one_version_one_wins_one_gets_412(user):
    client = api_client(user)
    job = client.post("/api/v1/jobs/", job_body(), format="json").json()

    def rename(name):
        return lambda: api_client(user).patch(
            f"/api/v1/jobs/{job['id']}/", {"name": name}, format="json", HTTP_IF_MATCH="1"
        )

    with transaction.atomic():
        # Both requests read version 1, then queue behind this row lock with their UPDATE.
        Job.objects.select_for_update().get(id=job["id"])
        threads, responses = in_threads(rename("left"), rename("right"))
        wait_for_lock_waiters(2)
    for thread in threads:
        thread.join(30)

    assert sorted(r.status_code for r in responses) == [200, 412]
    winner = next(r for r in responses if r.status_code == 200).json()["name"]
    stored = Job.objects.get(id=job["id"])
    assert (stored.version, stored.name) == (2, winner)
    assert JobVersion.objects.filter(job_id=job["id"]).count() == 2
    connection.close()


def test_two_concurrent_creations_with_one_key_make_one_job(user):
    def post():
        return api_client(user).post(
            "/api/v1/jobs/", job_body(), format="json", HTTP_IDEMPOTENCY_KEY="same"
        )

    with transaction.atomic():
        # A third holder of the key: both requests block on the unique index behind it.
        IdempotencyRecord.objects.create(
            owner=user,
            scope="jobs.create",
            key="same",
            request_hash="-",
            response_status=0,
            response_body={},
            created_at=timezone.now(),
        )
        threads, responses = in_threads(post, post)
        wait_for_lock_waiters(2)
        transaction.set_rollback(True)  # ...and then gives it up
    for thread in threads:
        thread.join(30)

    assert [r.status_code for r in responses] == [201, 201]
    assert responses[0].json() == responses[1].json()
    assert Job.objects.count() == 1
    assert IdempotencyRecord.objects.count() == 1
    connection.close()
