"""The API's answers to what a newcomer gets wrong: JSON everywhere under /api/ with the
field named (bad ids in paths, bad cursors, another authorization scheme), a job's args
checked against its handler and run_at kept to its window; the API's root, the landing
page and the docs page's way to sign in; a job's last outcome."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from rest_framework.test import APIClient

from jobs.models import Job, Run
from jobs.transitions import attempt_fail, attempt_succeed
from tests.factories import claim, job_body, later, queued_run, superuser

pytestmark = pytest.mark.django_db
JOBS = "/api/v1/jobs/"
HOUR = dt.timedelta(hours=1)


def _iso(delta: dt.timedelta) -> str:
    return (dt.datetime.now(dt.UTC) + delta).isoformat()


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("/api/v1/jobs/not-a-uuid/", "job_id"),
        ("/api/v1/jobs/123/pause/", "job_id"),
        ("/api/v1/runs/xyz/", "run_id"),
        ("/api/v1/runs/xyz/logs/", "run_id"),
    ],
)
def test_a_bad_id_in_a_path_answers_json_404_naming_it(api, path, field):
    response = api.get(path)
    assert response.status_code == 404
    assert response["Content-Type"] == "application/json"
    assert "UUID" in response.json()[field][0]


def test_an_unknown_api_path_answers_json_404(api):
    response = api.get("/api/v1/nothing-here/")
    assert response.status_code == 404
    assert "/api/v1/" in response.json()["detail"]


def test_a_well_formed_unknown_id_answers_json_404(api):
    response = api.get(f"{JOBS}{uuid.uuid4()}/")
    assert (response.status_code, response["Content-Type"]) == (404, "application/json")


@pytest.mark.parametrize("path", [JOBS, "/api/v1/runs/"])
def test_a_bad_cursor_answers_400_naming_cursor(api, path):
    response = api.get(path, {"cursor": "garbage"})
    assert response.status_code == 400
    assert "cursor" in response.json()


def test_another_authorization_scheme_answers_401_with_the_right_one(db):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Bearer abc")
    response = client.get(JOBS)
    assert response.status_code == 401
    assert "Authorization: Token <key>" in response.json()["detail"]
    assert "Bearer" in response.json()["detail"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"task": "tests.fail", "args": ["a", "b"]}, "args"),
        ({"task": "tests.fail", "kwargs": {"colour": "red"}}, "kwargs"),
        ({"task": "scheduler.sleep", "args": [1], "kwargs": {"seconds": 2}}, "args"),
    ],
)
def test_arguments_the_handler_cannot_take_answer_400(api, body, field):
    response = api.post(JOBS, job_body(**body), format="json")
    assert response.status_code == 400, response.content
    assert field in response.json()
    assert not Run.objects.exists()


def test_arguments_the_handler_takes_are_accepted(api):
    for body in ({"task": "tests.fail", "args": ["x"]},
                 {"task": "tests.fail", "kwargs": {"message": "x"}},
                 {"task": "tests.record", "args": [1, 2], "kwargs": {"a": 1}}):  # fmt: skip
        assert api.post(JOBS, job_body(**body), format="json").status_code == 201


@pytest.mark.parametrize(
    ("run_at", "ok"),
    [
        ("0001-01-01T00:00:00Z", False),
        ("9999-12-31T00:00:00Z", False),
        (_iso(dt.timedelta(days=-2)), False),
        (_iso(dt.timedelta(days=3660)), False),
        (_iso(dt.timedelta(hours=-1)), True),
        (_iso(dt.timedelta(days=3000)), True),
    ],
)
def test_run_at_is_kept_to_its_window(api, run_at, ok):
    body = job_body(schedule={"kind": "once", "run_at": run_at})
    response = api.post(JOBS, body, format="json")
    if ok:
        assert response.status_code == 201, response.content
    else:
        assert response.status_code == 400
        assert "run_at" in response.json()["schedule"]


def test_a_patch_leaving_the_schedule_alone_does_not_rejudge_run_at(api, user):
    created = api.post(JOBS, job_body(schedule={"kind": "once", "run_at": _iso(HOUR)}),
                       format="json").json()  # fmt: skip
    job = Job.objects.get(id=created["id"])
    job.spec["schedule"]["run_at"] = "2020-01-01T00:00:00+00:00"  # as if created long ago
    Job.objects.filter(id=job.id).update(spec=job.spec)
    response = api.patch(f"{JOBS}{job.id}/", {"name": "renamed"}, format="json")
    assert response.status_code == 200, response.content


def test_the_api_root_lists_its_roots(db):
    response = APIClient().get("/api/v1/")
    assert response.status_code == 200
    urls = {root["name"]: root["url"] for root in response.json()["roots"]}
    assert urls["job-list"].endswith("/api/v1/jobs/")
    assert urls["api-docs"].endswith("/api/docs/")


def test_the_docs_page_sends_a_signed_out_visitor_to_sign_in(client):
    response = client.get("/api/docs/")
    assert response.status_code == 302
    assert response["Location"] == "/admin/login/?next=/api/docs/"


def test_the_landing_page(client):
    assert b"Sign in" in client.get("/").content
    superuser("root")
    client.login(username="root", password="pw")
    page = client.get("/").content.decode()
    for link in ('href="/admin/"', 'href="/dashboard/"', 'href="/api/docs/"'):
        assert link in page


def _end(run, how) -> None:
    attempt = claim(run)
    if how == "failed":
        assert attempt_fail(attempt=attempt, now=later(1), error="boom", retry_at=None)
    else:
        assert attempt_succeed(attempt=attempt, now=later(1))


@pytest.mark.parametrize("how", ["failed", "succeeded"])
def test_a_completed_one_time_job_shows_its_last_outcome(api, user, how):
    run = queued_run(user)
    assert api.get(f"{JOBS}{run.job_id}/").json()["last_run_state"] is None
    _end(run, how)
    job = api.get(f"{JOBS}{run.job_id}/").json()
    assert (job["state"], job["last_run_state"]) == ("completed", how)
    assert dt.datetime.fromisoformat(job["last_run_at"]) == later(1)
    [listed] = api.get(JOBS).json()["results"]
    assert listed["last_run_state"] == how
