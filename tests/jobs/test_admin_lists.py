"""The admin's job and run lists (newest first, short ids, the last outcome, the filters
that matter) and the buttons of a job's and a run's page: only the actions its state
allows, by the transition tables the services use (jobs.transitions)."""

from __future__ import annotations

import re

import pytest

from jobs.admin.model_admins import RunAdmin
from jobs.models import Job, JobState, Run, RunState
from jobs.transitions import JOB_ACTION_STATES, RUN_ACTION_STATES, attempt_fail
from tests.factories import claim, later

pytestmark = pytest.mark.django_db
HOURLY = {"kind": "cron", "expression": "0 * * * *", "timezone": "UTC"}
JOB_BUTTONS = ("pause_jobs", "resume_jobs", "cancel_jobs", "trigger_jobs", "backfill_jobs")
RUN_BUTTONS = ("cancel_runs", "replay_runs")


def _buttons(page: str) -> set[str]:
    return set(re.findall(r'id="do-([a-z_]+)"', page))


@pytest.mark.parametrize(
    ("state", "offered"),
    [
        (JobState.ACTIVE, {"pause_jobs", "cancel_jobs", "trigger_jobs", "backfill_jobs"}),
        (JobState.PAUSED, {"resume_jobs", "cancel_jobs", "trigger_jobs", "backfill_jobs"}),
        (JobState.CANCELLED, set()),
        (JobState.COMPLETED, set()),
    ],
)
def test_a_job_page_offers_the_actions_its_state_allows(client, admin_superuser, make_job,
                                                        state, offered):  # fmt: skip
    job = make_job(schedule=HOURLY)
    Job.objects.filter(id=job.id).update(state=state)
    page = client.get(f"/admin/jobs/job/{job.id}/change/").content.decode()
    assert _buttons(page) == offered


@pytest.mark.parametrize("state", RunState.values)
def test_a_run_page_offers_the_actions_its_state_allows(client, admin_superuser, queued_run,
                                                        state):  # fmt: skip
    run = queued_run()
    Run.objects.filter(id=run.id).update(state=state)
    page = client.get(f"/admin/jobs/run/{run.id}/change/").content.decode()
    expected = {f"{action.split('.')[1]}_runs" for action, states in RUN_ACTION_STATES.items()
                if state in states}  # fmt: skip
    assert _buttons(page) == expected
    assert ("cancel_runs" in expected) == (state in ("pending", "queued", "retry_wait", "running"))


def test_the_action_tables_follow_the_transition_tables():
    assert JOB_ACTION_STATES["job.pause"] == {JobState.ACTIVE}
    assert JOB_ACTION_STATES["job.resume"] == {JobState.PAUSED}
    assert JobState.CANCELLED not in set().union(*JOB_ACTION_STATES.values())
    assert RUN_ACTION_STATES["run.replay"] == {RunState.FAILED, RunState.CANCELLED}


def test_the_lists_put_the_newest_first_with_short_ids_and_the_last_outcome(
    client, admin_superuser, queued_run
):
    older = queued_run(name="first-made")
    assert attempt_fail(attempt=claim(older), now=later(1), error="boom", retry_at=None)
    newer = queued_run(name="second-made", run_at=later(60))
    page = client.get("/admin/jobs/job/").content.decode()
    assert page.index("second-made") < page.index("first-made")
    assert f'title="{older.job_id}">{str(older.job_id)[:8]}</code>' in page
    assert 'class="state state-failed"' in page  # the older one-time job: completed, failed
    page = client.get("/admin/jobs/run/").content.decode()
    assert page.index(str(newer.id)[:8]) < page.index(str(older.id)[:8])
    assert str(newer.id) not in re.sub(r'(title|href|value|aria-label)="[^"]*"', "", page)


def test_the_lists_filter_by_state_queue_task_and_owner(client, admin_superuser, make_job, user):
    make_job(schedule=HOURLY)
    make_job(schedule=HOURLY, owner=admin_superuser, task="tests.fail")  # two of each
    page = client.get("/admin/jobs/job/").content.decode()
    for field in ("state", "queue", "task", "owner"):
        assert f"?{field}" in page or f"{field}__" in page or f"{field}=" in page, field
    assert (
        client.get("/admin/jobs/job/", {"owner__id__exact": admin_superuser.id}).status_code == 200
    )
    run_filters = {f if isinstance(f, str) else f[0] for f in RunAdmin.list_filter}
    assert {"state", "job__queue", "job__task", "job__owner"} <= run_filters
