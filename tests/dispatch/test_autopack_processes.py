"""Packing that decides itself, with a real scheduler, relay and Celery worker: the runs of
a task that declares nothing travel several to a message once its first runs show it short,
alone while it is long; a declared `pack` wins. Runs that shared a message share their
attempts' task id (a pack's is its first run's message id)."""

import collections
import datetime as dt

import pytest

from dispatch.packing import PROBE_RUNS
from jobs.models import Attempt, Run, RunState
from tests.processes import wait_for

pytestmark = pytest.mark.slow


def _due_jobs(user, *, task: str, count: int, args=()) -> None:
    from jobs.api.validation import JobSpecSerializer
    from jobs.services import job_create

    now = dt.datetime.now(dt.UTC)
    for index in range(count):
        spec = JobSpecSerializer(
            data={"name": f"j{index}", "task": task, "args": list(args),
                  "schedule": {"kind": "once", "run_at": now.isoformat()}}
        )  # fmt: skip
        spec.is_valid(raise_exception=True)
        job_create(owner=user, spec=spec.validated_data, now=now)


def _pack_sizes(stack, *, count: int, timeout: float = 60) -> list[int]:
    """Once `count` runs succeeded: how many runs each message carried, largest first."""
    stack.worker(concurrency=2)
    stack.relay()
    stack.scheduler()
    wait_for(
        lambda: Run.objects.filter(state=RunState.SUCCEEDED).count() == count,
        timeout=timeout,
        message=f"{count} runs to succeed",
    )
    assert Attempt.objects.count() == count  # each run once, with its own attempt
    task_ids = collections.Counter(Attempt.objects.values_list("task_id", flat=True))
    return sorted(task_ids.values(), reverse=True)


def test_a_short_task_declaring_nothing_is_packed_after_its_first_runs(stack, user):
    _due_jobs(user, task="tests.record", count=60)
    sizes = _pack_sizes(stack, count=60)
    # The probe's runs travel alone; the rest, shown short by them, several to a message.
    assert sizes.count(1) >= PROBE_RUNS
    assert sizes[0] > 1, sizes
    assert len(sizes) < 60 - PROBE_RUNS


def test_a_long_task_declaring_nothing_is_never_packed(stack, user):
    _due_jobs(user, task="tests.sleep", count=PROBE_RUNS + 4, args=[5])
    stack.worker("worker2", concurrency=2)
    sizes = _pack_sizes(stack, count=PROBE_RUNS + 4, timeout=120)
    assert sizes == [1] * (PROBE_RUNS + 4)


def test_a_task_declaring_pack_1_is_never_packed(stack, user):
    _due_jobs(user, task="tests.record_alone", count=40)
    assert _pack_sizes(stack, count=40) == [1] * 40


def test_a_declared_pack_size_is_kept(stack, user):
    _due_jobs(user, task="tests.record_packed", count=45)
    assert _pack_sizes(stack, count=45) == [20, 20, 5]
