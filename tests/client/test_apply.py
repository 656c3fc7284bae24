"""Jobs as code: `schedctl apply -f FILE` against a live server. Twice changes nothing;
a changed file versions exactly the changed jobs; --prune cancels exactly the missing
ones; two applies at once leave one job per name."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from jobs.models import Job, JobState, JobVersion
from tests.factories import make_job, owner, token_for

from .helpers import ok, schedctl

JOBS = [
    {"name": "nightly", "task": "tests.record",
     "schedule": {"kind": "cron", "expression": "0 3 * * *", "timezone": "Europe/Berlin"}},
    {"name": "every five", "task": "tests.record", "args": [1, 2],
     "schedule": {"kind": "interval", "every_seconds": 300}, "retry": {"max_attempts": 5}},
    {"name": "weekly", "task": "tests.record", "kwargs": {"week": True},
     "schedule": {"kind": "cron", "expression": "0 8 * * MON"}, "labels": {"team": "ops"}},
]  # fmt: skip


@pytest.fixture
def apply(live_server, transactional_db, tmp_path):
    token = token_for(owner("applier"))

    def run(jobs: list[dict], *flags: str, fmt: str = "yaml"):
        path = tmp_path / f"jobs.{fmt}"
        text = yaml.safe_dump({"jobs": jobs}) if fmt == "yaml" else json.dumps({"jobs": jobs})
        path.write_text(text)
        result = ok(schedctl("apply", "-f", str(path), *flags, "-o", "json",
                             url=live_server.url, token=token))  # fmt: skip
        return {c["name"]: c for c in result.json()["changes"]}

    return run


def actions(changes: dict) -> dict:
    return {name: change["action"] for name, change in changes.items()}


def versions() -> int:
    return JobVersion.objects.count()


def test_apply_twice_then_a_changed_file_then_prune(apply):
    planned = apply(JOBS, "--dry-run")
    assert actions(planned) == dict.fromkeys(["nightly", "every five", "weekly"], "create")
    assert not Job.objects.exists()  # a dry run writes nothing

    assert actions(apply(JOBS)) == dict.fromkeys(["nightly", "every five", "weekly"], "create")
    assert versions() == 3
    assert Job.objects.get(name="every five").spec["retry"]["max_attempts"] == 5
    assert Job.objects.get(name="weekly").labels == {"team": "ops", "managed-by": "schedctl"}

    # Twice: nothing changes (JSON this time: the same jobs), no version is written.
    again = apply(JOBS, fmt="json")
    assert actions(again) == dict.fromkeys(["nightly", "every five", "weekly"], "unchanged")
    assert versions() == 3

    # A changed file: exactly the changed jobs get a new version. A field dropped from the
    # file (weekly's kwargs) goes back to its default.
    changed = [
        JOBS[0],
        {**JOBS[1], "retry": {"max_attempts": 2}},
        {k: v for k, v in JOBS[2].items() if k != "kwargs"},
    ]
    plan = apply(changed, "--dry-run")
    assert actions(plan) == {"nightly": "unchanged", "every five": "update", "weekly": "update"}
    assert plan["every five"]["fields"] == ["retry"]
    assert plan["weekly"]["fields"] == ["kwargs"]
    assert versions() == 3
    done = apply(changed)
    assert actions(done) == actions(plan)
    assert done["every five"]["version"] == 2 and done["weekly"]["version"] == 2
    assert Job.objects.get(name="weekly").spec["kwargs"] == {}
    assert Job.objects.get(name="nightly").version == 1
    assert versions() == 5

    # --prune cancels exactly the jobs the file no longer names, and only managed ones.
    unmanaged = make_job(owner("applier"), name="made by hand", task="tests.record")
    pruned = apply([changed[0]], "--prune")
    assert actions(pruned) == {"nightly": "unchanged", "every five": "prune", "weekly": "prune"}
    states = dict(Job.objects.values_list("name", "state"))
    assert states == {"nightly": JobState.ACTIVE, "every five": JobState.CANCELLED,
                      "weekly": JobState.CANCELLED, "made by hand": JobState.ACTIVE}  # fmt: skip
    assert Job.objects.get(id=unmanaged.id).state == JobState.ACTIVE
    # A pruned name comes back as a new job.
    assert actions(apply(changed[:2])) == {"nightly": "unchanged", "every five": "create"}
    assert Job.objects.filter(name="every five", state=JobState.ACTIVE).count() == 1


def test_two_applies_at_once_leave_one_job_per_name(apply):
    many = [{**JOBS[0], "name": f"job {index}"} for index in range(8)]
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda _: apply(many), range(2))
    live = Job.objects.filter(state=JobState.ACTIVE)
    assert sorted(live.values_list("name", flat=True)) == sorted(j["name"] for j in many)
    assert live.count() == 8 and versions() == 8
    for name in first:
        # Each job was created by one of the two; the other found it equal.
        assert sorted([first[name]["action"], second[name]["action"]]) in (
            ["create", "unchanged"],
            ["create", "create"],  # both planned create; the loser was answered 409, then equal
        ), (first[name], second[name])
        assert first[name]["job"] == second[name]["job"]


def test_the_api_keeps_managed_names_unique(live_server, transactional_db):
    from tests.factories import api_client

    api = api_client(owner("uniq"))
    body = {"name": "only one", "task": "tests.record", "labels": {"managed-by": "schedctl"},
            "schedule": {"kind": "interval", "every_seconds": 60}}  # fmt: skip
    first = api.post("/api/v1/jobs/", body, format="json")
    assert first.status_code == 201
    second = api.post("/api/v1/jobs/", body, format="json")
    assert second.status_code == 409 and second.json()["job"] == first.json()["id"]
    bulk = api.post("/api/v1/jobs/bulk/", [body], format="json")
    assert bulk.status_code == 409
    # Unmanaged jobs may share a name, as before; a managed one renamed onto a taken name: 409.
    plain = {k: v for k, v in body.items() if k != "labels"}
    assert api.post("/api/v1/jobs/", plain, format="json").status_code == 201
    assert api.post("/api/v1/jobs/", plain, format="json").status_code == 201
    other = api.post("/api/v1/jobs/", {**body, "name": "another"}, format="json").json()
    patched = api.patch(f"/api/v1/jobs/{other['id']}/", {"name": "only one"}, format="json")
    assert patched.status_code == 409
    # Once cancelled, the name is free again.
    api.post(f"/api/v1/jobs/{first.json()['id']}/cancel/")
    assert api.post("/api/v1/jobs/", body, format="json").status_code == 201
    # A dry run: the body as stored, every default filled in; nothing created.
    before = Job.objects.count()
    dry = api.post("/api/v1/jobs/?dry_run=true", plain, format="json")
    assert dry.status_code == 200 and dry.json()["retry"]["max_attempts"] == 3
    assert Job.objects.count() == before


def test_concurrent_creations_of_one_managed_name_make_one_job(live_server, transactional_db):
    import threading

    import requests

    token = token_for(owner("racer"))
    body = {"name": "raced", "task": "tests.record", "labels": {"managed-by": "schedctl"},
            "schedule": {"kind": "interval", "every_seconds": 60}}  # fmt: skip
    barrier = threading.Barrier(6)

    def create(index: int) -> int:
        barrier.wait()
        return requests.post(
            f"{live_server.url}/api/v1/jobs/",
            json=body,
            headers={"Authorization": f"Token {token}", "Idempotency-Key": f"k{index}"},
            timeout=60,
        ).status_code

    with ThreadPoolExecutor(6) as pool:
        statuses = sorted(pool.map(create, range(6)))
    assert statuses == [201] + [409] * 5
    assert Job.objects.filter(name="raced").count() == 1
