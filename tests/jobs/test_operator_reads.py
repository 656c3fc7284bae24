"""An operator reads every owner's jobs through the API, never their secrets: the spec and
the history (versions, diffs, audit data) come masked to anyone but the job's owner, who
gets their own data as given (docs/security.md)."""

from __future__ import annotations

import pytest

from tests import factories

pytestmark = pytest.mark.django_db

SECRETS = {"password": "canary-a1", "nested": {"api_key": "canary-b2"},
           "db": "postgres://app:canary-c3@db/x"}  # fmt: skip


def test_an_operator_sees_other_owners_jobs_with_their_secrets_masked(api, user, operator_api):
    created = api.post(
        "/api/v1/jobs/",
        factories.job_body(kwargs=SECRETS, schedule={"kind": "cron", "expression": "0 * * * *"}),
        format="json",
    )
    assert created.status_code == 201, created.content
    job_id = created.json()["id"]
    changed = api.patch(f"/api/v1/jobs/{job_id}/", {"kwargs": {**SECRETS, "password": "canary-d4"}},
                        format="json")  # fmt: skip
    assert changed.status_code == 200, changed.content

    # The owner: as given.
    assert api.get(f"/api/v1/jobs/{job_id}/").json()["kwargs"]["password"] == "canary-d4"
    assert b"canary-a1" in api.get(f"/api/v1/jobs/{job_id}/history/").content
    # An operator: every read masked, the job itself, lists and its history with the diff.
    for url in (f"/api/v1/jobs/{job_id}/", "/api/v1/jobs/", f"/api/v1/jobs/{job_id}/history/"):
        response = operator_api.get(url)
        assert response.status_code == 200, (url, response.content)
        for canary in (b"canary-a1", b"canary-b2", b"canary-c3", b"canary-d4"):
            assert canary not in response.content, (url, canary)
    assert b"[REDACTED]" in operator_api.get(f"/api/v1/jobs/{job_id}/history/").content
