"""A bulk replay with real processes: the web process and the relay working the operation
are SIGKILLed mid-way; after their restart every failed run is replayed exactly once,
runs exactly once, and the operation ends done with the right counts; the dry run's count
equals the operation's `matched`. The full size (10,000 runs) is a drill."""

import collections
import datetime as dt
import math

import pytest
import requests

from dispatch.management.commands.standalone import web_argv
from dispatch.scheduler import SchedulerConfig, scheduler_run_once
from jobs.models import AuditEvent, BulkOperation, OutboxMessage, Run, RunState
from jobs.services import job_create_bulk
from tests.factories import job_spec, owner, token_for
from tests.jobs.test_throttling import free_port, web_up
from tests.processes import wait_for

pytestmark = pytest.mark.slow
NEAR_TERM = 40  # one-time runs due every half second while the operation is under way


def _failed_runs(user, count: int) -> list:
    """`count` runs of one-time jobs, failed (no attempt left) and out of the outbox."""
    past = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    specs = [job_spec(task="tests.record", labels={"batch": "replayed"},
                      schedule={"kind": "once", "run_at": past.isoformat()})] * count  # fmt: skip
    jobs = job_create_bulk(owner=user, specs=specs, now=past - dt.timedelta(minutes=1))
    config = SchedulerConfig()
    while scheduler_run_once(now=dt.datetime.now(dt.UTC), config=config).batch_full:
        pass
    runs = Run.objects.filter(job__in=jobs)
    OutboxMessage.objects.filter(run__in=runs).delete()
    runs.update(state=RunState.FAILED, failure_reason="error", finished_at=past)
    assert runs.count() == count
    return list(runs.values_list("id", flat=True))


def _bulk_replay_survives_kills(stack, *, count: int, batch: int, report_figure) -> None:
    user = owner("bulk-replayer")
    run_ids = _failed_runs(user, count)
    port = free_port()
    stack.start("web", web_argv(host="127.0.0.1", port=port, workers=1))
    wait_for(lambda: web_up(port), timeout=60, message="the web process")
    relay = ["--bulk-batch-size", str(batch)]
    stack.relay("relay", *relay)
    stack.worker("worker", concurrency=2)
    url = f"http://127.0.0.1:{port}/api/v1/runs/bulk/replay/"
    headers = {"Authorization": f"Token {token_for(user)}", "Idempotency-Key": "replay-1"}
    body = {"filter": {"state": "failed"}}
    dry = requests.post(url, json={**body, "dry_run": True}, headers=headers, timeout=60)
    assert dry.json() == {"matched": count}, dry.text
    created = requests.post(url, json=body, headers=headers, timeout=120)
    assert created.status_code == 202, created.text
    operation = BulkOperation.objects.get(id=created.json()["id"])
    assert operation.matched == count
    progress = BulkOperation.objects.filter(id=operation.id)
    wait_for(lambda: progress.values_list("done", flat=True)[0] >= batch, timeout=120,
             message="the operation to be under way")  # fmt: skip
    stack.kill("relay")
    stack.kill("web")
    done_at_kill = progress.values_list("done", flat=True)[0]
    stack.restart("web")
    stack.restart("relay")
    wait_for(lambda: web_up(port), timeout=60, message="the web process again")
    again = requests.post(url, json=body, headers=headers, timeout=60)
    assert again.json()["id"] == str(operation.id)  # the same key: the same operation
    # Near-term runs of the same queue meanwhile: their lateness (start - due).
    stack.scheduler("scheduler")
    soon = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=3)
    near = job_create_bulk(owner=user, specs=[
        job_spec(task="tests.record", schedule={"kind": "once", "run_at": (
            soon + dt.timedelta(seconds=i / 2)).isoformat()}) for i in range(NEAR_TERM)
    ], now=dt.datetime.now(dt.UTC))  # fmt: skip
    wait_for(lambda: progress.values_list("state", flat=True)[0] == "done",
             timeout=120 + count / 20, message="the operation to end")  # fmt: skip
    operation.refresh_from_db()
    assert (operation.matched, operation.done, operation.refused) == (count, count, {})
    runs = Run.objects.filter(id__in=run_ids)
    wait_for(lambda: runs.filter(state=RunState.SUCCEEDED).count() == count,
             timeout=120 + count / 20, message="every replayed run to succeed")  # fmt: skip
    replays = collections.Counter(
        AuditEvent.objects.filter(action="run.replayed", run_id__in=run_ids)
        .values_list("run_id", flat=True)
    )  # fmt: skip
    assert set(replays.values()) == {1} and len(replays) == count
    assert AuditEvent.objects.filter(action="run.replayed", actor=user).count() == count
    executed = collections.Counter(e["run_id"] for e in stack.executions())
    assert {str(run_id) for run_id in run_ids} <= set(executed)
    assert max(executed[str(run_id)] for run_id in run_ids) == 1
    took = (operation.finished_at - operation.created_at).total_seconds()
    near_runs = Run.objects.filter(job__in=near)
    wait_for(lambda: near_runs.filter(state=RunState.SUCCEEDED).count() == NEAR_TERM,
             timeout=120, message="the near-term runs to succeed")  # fmt: skip
    late = sorted((at - due).total_seconds() for due, at in near_runs.values_list(
        "scheduled_for", "started_at"))  # fmt: skip
    report_figure(
        f"bulk replay of {count}: {NEAR_TERM} near-term runs of the same queue, due meanwhile, "
        f"started late by p50 {late[NEAR_TERM // 2]:.2f} s, p99 {late[-1]:.2f} s"
    )
    report_figure(
        f"bulk replay of {count} failed runs, relay and web SIGKILLed at {done_at_kill} done: "
        f"all replayed once, operation done in {took:.1f} s "
        f"({math.ceil(count / batch)} batches of {batch})"
    )


def test_a_bulk_replay_survives_its_relay_and_web_killed(stack, report_figure):
    _bulk_replay_survives_kills(stack, count=400, batch=50, report_figure=report_figure)


@pytest.mark.drill
@pytest.mark.timeout(1500)
def test_drill_bulk_replay_of_10000(stack, report_figure):
    _bulk_replay_survives_kills(stack, count=10_000, batch=100, report_figure=report_figure)
