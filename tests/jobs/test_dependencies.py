"""Dependencies between jobs (jobs.dependencies, dispatch.dependencies, the trigger of
storage.dependencies): a run's end creates its dependents' runs once, fan-in waits for
every upstream, skips propagate with their `upstream:` reason, within_seconds expires by
its own index, a paused dependent decides by its misfire policy on resume."""

from __future__ import annotations

import datetime as dt

import pytest

from jobs.dependencies import dependency_graph
from jobs.dependencies import dependency_upstream_runs as upstream_of_run
from jobs.models import (
    DependencyGate,
    DependencySignal,
    Job,
    JobDependency,
    OutboxMessage,
    Run,
    RunKind,
    RunState,
)
from jobs.services import job_cancel, job_pause, job_resume, job_trigger
from jobs.transitions import attempt_fail, attempt_succeed, run_cancel
from tests.factories import PINNED_NOW, claim, later, make_job, scheduler_pass

pytestmark = pytest.mark.django_db

CRON = {"kind": "cron", "expression": "* * * * *"}


def head(user, name="A", schedule=CRON, **overrides):
    start = PINNED_NOW - dt.timedelta(minutes=1)
    return make_job(user, now=start, name=name, schedule=schedule, **overrides)


def after(user, *upstreams, name="B", **schedule):
    return make_job(
        user,
        now=PINNED_NOW - dt.timedelta(minutes=1),
        name=name,
        schedule={"kind": "after", "jobs": [str(job.id) for job in upstreams], **schedule},
    )


def upstream_of(run):
    return upstream_of_run(run=run)


def apply(at):
    """The scheduler's dependencies step alone (a pass's other steps have nothing to do)."""
    from dispatch.dependencies import DependenciesConfig, dependencies_run_once

    return dependencies_run_once(now=at, config=DependenciesConfig())


def run_of(job, at=PINNED_NOW, kind=RunKind.SCHEDULED) -> Run | None:
    return Run.objects.filter(job=job, scheduled_for=at, kind=kind).first()


def end(run, state=RunState.SUCCEEDED, at=None):
    """The run's attempt claimed and ended `state` (succeeded, failed or cancelled)."""
    at = at or later(5)
    if state == RunState.CANCELLED:
        assert run_cancel(run_id=run.id, now=at)
        return
    attempt = claim(run, at=at)
    if state == RunState.SUCCEEDED:
        assert attempt_succeed(attempt=attempt, now=at)
    else:
        assert attempt_fail(attempt=attempt, now=at, error="boom", retry_at=None)


def test_a_chain_runs_once_per_occurrence_with_the_instant_kind_and_upstream_runs(user):
    a = head(user)
    b = after(user, a)
    c = after(user, b, name="C")
    scheduler_pass(PINNED_NOW)
    a_run = run_of(a)
    assert JobDependency.objects.filter(upstream=a).count() == 1
    assert Job.objects.get(id=b.id).next_run_at is None
    end(a_run)
    assert DependencySignal.objects.filter(run_id=a_run.id).count() == 1
    result = scheduler_pass(later(6))
    assert result.dependent_runs_created == 1
    b_run = run_of(b)
    assert (b_run.state, upstream_of(b_run), b_run.kind) == ("queued", [a_run.id], "scheduled")
    assert OutboxMessage.objects.filter(run=b_run).count() == 1
    assert run_of(c) is None  # C waits for B's end
    end(b_run, at=later(7))
    scheduler_pass(later(8))
    assert upstream_of(run_of(c)) == [b_run.id]
    # A repeated signal (the same run's end delivered again) makes nothing new.
    DependencySignal.objects.create(run_id=a_run.id, job_id=a.id, state="succeeded",
                                    kind="scheduled", scheduled_for=PINNED_NOW,
                                    created_at=later(9))  # fmt: skip
    scheduler_pass(later(9))
    assert Run.objects.filter(job=b).count() == 1
    assert not DependencySignal.objects.exists()
    # The dependent is never completed for want of a next_run_at.
    assert Job.objects.get(id=b.id).state == "active"


def test_a_manual_or_backfill_head_gives_its_kind_and_lane_to_the_chain(user):
    a = head(user)
    b = after(user, a)
    manual = job_trigger(job=a, actor=user, now=later(1))
    end(manual)
    scheduler_pass(later(6))
    b_run = Run.objects.get(job=b)
    assert (b_run.kind, b_run.scheduled_for) == ("manual", manual.scheduled_for)
    assert OutboxMessage.objects.get(run=b_run).queue.endswith(".manual")


def test_fan_in_waits_for_every_upstream_and_a_failure_skips_the_chain(user):
    a1, a2 = head(user, "A1"), head(user, "A2")
    b = after(user, a1, a2)
    c = after(user, b, name="C")
    scheduler_pass(PINNED_NOW)
    scheduler_pass(PINNED_NOW + dt.timedelta(minutes=1))
    t0, t1 = PINNED_NOW, PINNED_NOW + dt.timedelta(minutes=1)
    end(run_of(a1, t0), at=later(70))
    scheduler_pass(later(71))
    assert run_of(b, t0) is None  # one of two: no run yet
    end(run_of(a2, t0), at=later(72))
    scheduler_pass(later(73))
    assert run_of(b, t0).state == "queued"
    assert set(upstream_of(run_of(b, t0))) == {run_of(a1, t0).id, run_of(a2, t0).id}
    # The next instant: A2 fails, so B and then C are skipped, each naming its decider.
    end(run_of(a1, t1), at=later(80))
    failed = run_of(a2, t1)
    end(failed, RunState.FAILED, at=later(81))
    scheduler_pass(later(82))
    skipped = run_of(b, t1)
    assert skipped.state == "skipped"
    assert skipped.skip_reason.startswith(f"upstream: job {a2.id} run {failed.id} ended failed")
    scheduler_pass(later(83))
    c_skip = run_of(c, t1)
    assert c_skip.state == "skipped"
    assert c_skip.skip_reason.startswith(f"upstream: job {b.id} run {skipped.id} ended skipped")


def test_cancelled_upstream_skips_and_on_failed_runs_only_on_failure(user):
    a = head(user)
    on_failure = after(user, a, name="cleanup", on="failed")
    scheduler_pass(PINNED_NOW)
    end(run_of(a), RunState.CANCELLED)
    scheduler_pass(later(6))
    assert run_of(on_failure).skip_reason.startswith("upstream:")
    scheduler_pass(PINNED_NOW + dt.timedelta(minutes=1))
    t1 = PINNED_NOW + dt.timedelta(minutes=1)
    end(run_of(a, t1), RunState.FAILED, at=later(65))
    scheduler_pass(later(66))
    assert run_of(on_failure, t1).state == "queued"


def test_within_seconds_expiry_skips_by_its_deadline(user):
    a1, a2 = head(user, "A1"), head(user, "A2")
    b = after(user, a1, a2, within_seconds=30)
    scheduler_pass(PINNED_NOW)
    first = run_of(a1)
    end(first, at=later(5))
    scheduler_pass(later(6))
    gate = DependencyGate.objects.get(job=b)
    assert gate.deadline_at == later(6) + dt.timedelta(seconds=30)
    scheduler_pass(later(30))
    assert run_of(b) is None
    scheduler_pass(later(37))
    skipped = run_of(b)
    assert skipped.state == "skipped"
    assert skipped.skip_reason.startswith(f"upstream: job {a1.id} run {first.id} waited 30s")
    assert str(a2.id) in skipped.skip_reason
    # A2 ending later changes nothing: the occurrence was decided.
    end(run_of(a2), at=later(40))
    scheduler_pass(later(41))
    assert Run.objects.filter(job=b).count() == 1


def test_a_fan_in_without_within_seconds_is_decided_by_the_default_bound(user, settings):
    """No `within_seconds`: SCHEDULER_DEPENDENCY_WITHIN_SECONDS bounds the wait, so an
    upstream that never runs at that instant skips the occurrence (and its dependents)
    instead of leaving a gate waiting for ever."""
    settings.SCHEDULER_DEPENDENCY_WITHIN_SECONDS = 120
    a1, a2 = head(user, "A1"), head(user, "A2")
    b = after(user, a1, a2)
    c = after(user, b, name="C")
    scheduler_pass(PINNED_NOW)
    first = run_of(a1)
    end(first, at=later(5))
    scheduler_pass(later(6))
    gate = DependencyGate.objects.get(job=b)
    assert gate.deadline_at == later(6) + dt.timedelta(seconds=120)
    scheduler_pass(later(125))
    assert run_of(b) is None
    scheduler_pass(later(127))
    skipped = run_of(b)
    assert skipped.state == "skipped"
    assert skipped.skip_reason == (
        f"upstream: job {a1.id} run {first.id} waited 120s (the default bound) for {a2.id}"
    )
    scheduler_pass(later(128))
    assert run_of(c).skip_reason.startswith(f"upstream: job {b.id} run {skipped.id} ended skipped")
    assert not DependencyGate.objects.filter(state="waiting").exists()


def test_a_paused_dependent_decides_by_its_misfire_policy_on_resume(user):
    a = head(user)
    b = after(user, a)
    b.spec["misfire"] = {"policy": "run_latest", "grace_seconds": 10}
    Job.objects.filter(id=b.id).update(spec=b.spec)
    b.refresh_from_db()
    assert job_pause(job=b, actor=user, now=PINNED_NOW)
    for minute in range(3):
        at = PINNED_NOW + dt.timedelta(minutes=minute)
        scheduler_pass(at)
        end(run_of(a, at), at=at + dt.timedelta(seconds=5))
        scheduler_pass(at + dt.timedelta(seconds=6))
    assert not Run.objects.filter(job=b).exists()
    assert DependencyGate.objects.filter(job=b, state="held").count() == 3
    b.refresh_from_db()
    assert job_resume(job=b, actor=user, now=later(300))
    scheduler_pass(later(300))
    runs = list(Run.objects.filter(job=b).order_by("scheduled_for").values_list("state", flat=True))
    assert runs == ["skipped", "skipped", "queued"]  # run_latest: the latest runs


def test_a_cancelled_dependent_takes_no_occurrence(user):
    a = head(user)
    b = after(user, a)
    assert job_cancel(job=b, actor=user, now=PINNED_NOW)
    scheduler_pass(PINNED_NOW)
    end(run_of(a))
    scheduler_pass(later(6))
    assert not Run.objects.filter(job=b).exists()
    assert not DependencySignal.objects.exists()


def test_a_run_without_dependents_writes_no_signal(user):
    a = head(user)
    scheduler_pass(PINNED_NOW)
    end(run_of(a))
    assert not DependencySignal.objects.exists()


def test_the_graph_is_transitive_and_bounded(user):
    a = head(user)
    b = after(user, a)
    c = after(user, b, name="C")
    graph = dependency_graph(job=b, visible=Job.objects.all())
    assert [(n.id, n.depth) for n in graph["upstream"]] == [(a.id, 1)]
    assert [(n.id, n.depth) for n in graph["downstream"]] == [(c.id, 1)]
    graph = dependency_graph(job=c, visible=Job.objects.all(), max_depth=1)
    assert [n.id for n in graph["upstream"]] == [b.id]


def test_the_completion_rule_spares_a_dependent_job_with_no_next_run(user):
    from storage.completion import jobs_complete_if_finished

    b = after(user, head(user))
    assert jobs_complete_if_finished(job_ids=[b.id], now=later(1)) == []


# -- the API: validation, the graph, upstream_runs --------------------------------------


def after_body(*upstream_ids, **schedule):
    from tests.factories import job_body

    jobs = [str(i) for i in upstream_ids]
    return job_body(name="dependent", schedule={"kind": "after", "jobs": jobs, **schedule})


def test_the_api_refuses_bad_on_invisible_upstreams_too_many_and_cycles(user, other_user):
    import uuid

    from jobs.dependencies import MAX_UPSTREAMS
    from tests.factories import api_client

    api = api_client(user)
    a = head(user)
    theirs = head(other_user, "theirs")
    answer = api.post("/api/v1/jobs/", after_body(a.id, on="sometimes"), format="json")
    assert answer.status_code == 400 and "on" in answer.json()["schedule"]
    # Another's job and a job that does not exist: the same words, saying nothing more.
    for unseen in (theirs.id, uuid.uuid4()):
        answer = api.post("/api/v1/jobs/", after_body(a.id, unseen), format="json")
        assert answer.status_code == 400
        assert answer.json()["schedule"]["jobs"] == [f"Not a job you can see: {unseen}."]
    ids = [head(user, f"u{n}").id for n in range(MAX_UPSTREAMS + 1)]
    answer = api.post("/api/v1/jobs/", after_body(*ids), format="json")
    assert answer.status_code == 400 and "jobs" in answer.json()["schedule"]
    answer = api.post("/api/v1/jobs/", after_body(a.id, within_seconds=0), format="json")
    assert answer.status_code == 400 and "within_seconds" in answer.json()["schedule"]
    # A -> B -> C; making A run after C closes a cycle: 400, and nothing changed.
    b = api.post("/api/v1/jobs/", after_body(a.id), format="json").json()
    c = api.post("/api/v1/jobs/", after_body(b["id"]), format="json").json()
    answer = api.patch(f"/api/v1/jobs/{a.id}/", after_body(c["id"]), format="json")
    assert answer.status_code == 400 and "cycle" in answer.json()["schedule"]["jobs"][0]
    answer = api.patch(f"/api/v1/jobs/{b['id']}/", after_body(b["id"]), format="json")
    assert answer.status_code == 400
    assert Job.objects.get(id=a.id).version == 1
    assert not JobDependency.objects.filter(dependent_id=a.id).exists()
    # A change of upstreams is a new version, audited, with its edges rewritten.
    a2 = head(user, "A2")
    answer = api.patch(f"/api/v1/jobs/{c['id']}/",
                       {"schedule": {"kind": "after", "jobs": [b["id"], str(a2.id)],
                                     "on": "finished"}}, format="json")  # fmt: skip
    assert answer.status_code == 200 and answer.json()["version"] == 2
    assert set(
        JobDependency.objects.filter(dependent_id=c["id"]).values_list("upstream_id", flat=True)
    ) == {uuid.UUID(b["id"]), a2.id}
    history = api.get(f"/api/v1/jobs/{c['id']}/history/").json()
    assert history["events"][0]["action"] == "job.updated"


def test_the_graph_and_upstream_runs_over_the_api(user, other_user):
    from tests.factories import api_client

    api = api_client(user)
    a = head(user)
    b = after(user, a)
    after(other_user, b, name="theirs")  # not the caller's: not listed
    scheduler_pass(PINNED_NOW)
    end(run_of(a))
    scheduler_pass(later(6))
    graph = api.get(f"/api/v1/jobs/{b.id}/graph/").json()
    assert [job["id"] for job in graph["upstream"]] == [str(a.id)]
    assert graph["downstream"] == []
    assert graph["upstream"][0]["state"] == "active"
    detail = api.get(f"/api/v1/runs/{run_of(b).id}/").json()
    assert detail["upstream_runs"] == [str(run_of(a).id)]


def test_preview_of_an_after_schedule_gives_the_instants_its_upstreams_share(user):
    from tests.factories import api_client

    api = api_client(user)
    every_minute = head(user, "A1")
    every_other = head(user, "A2", schedule={"kind": "cron", "expression": "*/2 * * * *"})
    b = after(user, every_minute, every_other)
    body = {"schedule": {"kind": "after", "jobs": [str(b.id)]}, "count": 3,
            "after": PINNED_NOW.isoformat()}  # fmt: skip
    answer = api.post("/api/v1/schedules/preview/", body, format="json")
    assert answer.status_code == 200, answer.json()
    got = [
        dt.datetime.fromisoformat(o["at"].replace("Z", "+00:00"))
        for o in answer.json()["occurrences"]
    ]
    assert got == [PINNED_NOW + dt.timedelta(minutes=m) for m in (2, 4, 6)]
    assert "upstream" in answer.json()["note"]


def test_fan_in_over_twenty_cron_boundaries_with_one_failure(user):
    a1, a2 = head(user, "A1"), head(user, "A2")
    b = after(user, a1, a2)
    c = after(user, b, name="C")
    failing = 7  # odd: A2 ends second that minute, and fails
    for minute in range(20):
        at = PINNED_NOW + dt.timedelta(minutes=minute)
        scheduler_pass(at)
        first, second = (a1, a2) if minute % 2 else (a2, a1)  # either may end first
        end(run_of(first, at), at=at + dt.timedelta(seconds=5))
        apply(at + dt.timedelta(seconds=6))
        assert run_of(b, at) is None  # never before both of its upstreams ended
        state = RunState.FAILED if minute == failing else RunState.SUCCEEDED
        end(run_of(second, at), state, at=at + dt.timedelta(seconds=7))
        apply(at + dt.timedelta(seconds=8))
        apply(at + dt.timedelta(seconds=9))  # a skip's own dependents
    runs = {run.scheduled_for: run for run in Run.objects.filter(job=b)}
    assert len(runs) == 20
    assert [at for at, run in runs.items() if run.state == "skipped"] == [
        PINNED_NOW + dt.timedelta(minutes=failing)
    ]
    for at, run in runs.items():
        ends = [run_of(job, at).finished_at for job in (a1, a2)]
        assert run.created_at >= max(ends)
    skipped = runs[PINNED_NOW + dt.timedelta(minutes=failing)]
    assert skipped.skip_reason.startswith(f"upstream: job {a2.id} run ")
    [c_run] = Run.objects.filter(job=c)  # B's queued runs have not ended; the skip did
    assert (c_run.state, c_run.scheduled_for) == ("skipped", skipped.scheduled_for)
    assert c_run.skip_reason.startswith(f"upstream: job {b.id} run {skipped.id}")


def test_the_admin_job_page_links_upstream_and_downstream(client, user):
    from tests.factories import superuser

    a = head(user)
    b = after(user, a, within_seconds=60)
    c = after(user, b, name="C")
    client.force_login(superuser("dependency-admin"))
    page = client.get(f"/admin/jobs/job/{b.id}/change/").content.decode()
    assert f'href="/admin/jobs/job/{a.id}/change/"' in page
    assert f'href="/admin/jobs/job/{c.id}/change/"' in page
    assert "After each run of 1 upstream job(s) ends succeeded" in page
    # Its next fires are its upstream's next occurrences (A fires every minute).
    fires = page.split('id="next-fires"')[1].split("</table>")[0]
    assert fires.count("<tr><td>20") == 10


def test_a_signal_that_fails_waits_and_the_others_go_on(user, monkeypatch):
    import jobs.dependencies as dependencies
    from dispatch.scheduler import scheduler_next_due

    a, broken = head(user), head(user, "broken")
    b, c = after(user, a), after(user, broken, name="C")
    scheduler_pass(PINNED_NOW)
    end(run_of(a))
    end(run_of(broken))
    original = dependencies.dependent_occurrence_arrive

    def arrive(*, job, signal, now, decisions):
        if job.id == c.id:
            raise RuntimeError("a bug")
        return original(job=job, signal=signal, now=now, decisions=decisions)

    monkeypatch.setattr(dependencies, "dependent_occurrence_arrive", arrive)
    scheduler_pass(later(6))
    assert run_of(b).state == "queued"
    [left] = DependencySignal.objects.all()
    assert left.created_at == later(6) + dependencies.SIGNAL_RETRY
    # The scheduler sleeps until then rather than spin on it.
    assert scheduler_next_due(now=later(7)) == later(6) + dependencies.SIGNAL_RETRY
    monkeypatch.setattr(dependencies, "dependent_occurrence_arrive", original)
    scheduler_pass(later(7))
    assert run_of(c) is None
    scheduler_pass(later(40))
    assert run_of(c).state == "queued"


def test_a_dependent_behind_its_calendar_is_skipped_by_the_one_decision(user):
    """A dependent's occurrence goes through the decision every occurrence takes
    (jobs.occurrences.occurrence_decide): its own calendar excludes the instant although
    its upstream succeeded, and the skip propagates to its dependents as `upstream:`."""
    from jobs.calendars import calendar_spec_check
    from jobs.models import Calendar

    freeze = Calendar.objects.create(owner=user, name="freeze", spec=calendar_spec_check(
        {"timezone": "UTC", "dates": [PINNED_NOW.date().isoformat()]}))  # fmt: skip
    a = head(user)
    b = after(user, a)
    Job.objects.filter(id=b.id).update(spec={**b.spec, "calendars": {"exclude": [str(freeze.id)]}})
    c = after(user, b, name="C")
    scheduler_pass(PINNED_NOW)
    end(run_of(a))
    scheduler_pass(later(6))
    b_run = run_of(b)
    assert b_run.state == RunState.SKIPPED
    assert b_run.skip_reason.startswith("calendar: 'freeze'"), b_run.skip_reason
    scheduler_pass(later(7))
    c_run = run_of(c)
    assert c_run.state == RunState.SKIPPED and c_run.skip_reason.startswith("upstream:")


def test_migration_0011_gives_gates_waiting_without_a_deadline_the_default(user, settings):
    """Gates left waiting without a deadline (before every gate had one) get the default
    bound from their creation; a decided gate and one with its own deadline are untouched."""
    import importlib

    from django.db import connection

    migration = importlib.import_module("jobs.migrations.0011_dependency_gate_default_deadline")
    settings.SCHEDULER_DEPENDENCY_WITHIN_SECONDS = 600
    a1, a2 = head(user, "A1"), head(user, "A2")
    b = after(user, a1, a2)
    own = PINNED_NOW + dt.timedelta(seconds=30)
    gates = [
        DependencyGate.objects.create(
            job=b,
            scheduled_for=PINNED_NOW + dt.timedelta(minutes=i),
            kind="scheduled",
            missing=1,
            created_at=PINNED_NOW,
            state=state,
            deadline_at=deadline,
        )  # fmt: skip
        for i, (state, deadline) in enumerate(
            [("waiting", None), ("waiting", own), ("decided", None)]
        )
    ]
    with connection.schema_editor() as editor:
        migration.gates_bound(None, editor)
    deadlines = [DependencyGate.objects.get(id=g.id).deadline_at for g in gates]
    assert deadlines == [PINNED_NOW + dt.timedelta(seconds=600), own, None]
