"""Job history (jobs.selectors): the events of the job's runs, truncated values, capped
versions. Clocks are pinned."""

import datetime as dt

from jobs.models import Run
from jobs.outcomes import attempt_record_failure
from jobs.transitions import run_claim
from tests.factories import job_patch as patch
from tests.factories import scheduler_pass as run_once

T0 = dt.datetime(2030, 1, 1, 0, 0, tzinfo=dt.UTC)
H = dt.timedelta(hours=1)


def test_history_holds_the_events_of_the_jobs_runs(api, make_job):
    job = make_job(
        now=T0 - dt.timedelta(minutes=1), schedule={"kind": "once", "run_at": T0.isoformat()}
    )
    run_once(T0)
    run = Run.objects.get(job=job)
    attempt = run_claim(run_id=run.id, worker="w", now=T0, lease_seconds=30)
    attempt_record_failure(
        attempt=attempt, spec=job.spec, retry_base=0, ended="lost", error="lease expired",
        now=T0 + H, by="reaper",
    )  # fmt: skip
    body = api.get(f"/api/v1/jobs/{job.id}/history/").json()
    lost = [e for e in body["events"] if e["action"] == "attempt.lost"]
    assert len(lost) == 1 and lost[0]["run"] == str(run.id)
    assert body["more_events"] is False and body["more_versions"] is False


def test_history_truncates_large_values_and_caps_versions(api, make_job, user, monkeypatch):
    from jobs import selectors

    monkeypatch.setattr(selectors, "HISTORY_VERSIONS_LIMIT", 3)
    job = make_job(now=T0)
    for number in range(4):
        patch(job, user, T0, kwargs={"blob": str(number) * 10_000})
    body = api.get(f"/api/v1/jobs/{job.id}/history/").json()
    assert [v["version"] for v in body["versions"]] == [5, 4, 3]
    assert body["more_versions"] is True
    newest = body["versions"][0]
    assert newest["spec"]["kwargs"]["truncated"] is True
    assert newest["spec"]["name"] == job.spec["name"]
    assert newest["changes"][0]["field"] == "kwargs.blob"
    assert newest["changes"][0]["to"]["truncated"] is True
    assert len(api.get(f"/api/v1/jobs/{job.id}/history/").content) < 20_000
