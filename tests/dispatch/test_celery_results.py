"""SCHEDULER_CELERY_RESULTS: Celery's own tools see each delivery's task, and the admin links
the task and the run both ways; off by default (a write per task)."""

import pytest
from celery.result import AsyncResult
from django.conf import settings
from django.contrib.auth import get_user_model
from django.test import Client
from django_celery_results.backends import DatabaseBackend
from django_celery_results.models import TaskResult

from jobs.models import Attempt, Run, RunState
from scheduler_project.celery import app
from tests import factories
from tests.processes import wait_for


def test_results_are_off_by_default():
    assert settings.CELERY_RESULT_BACKEND is None
    assert settings.CELERY_TASK_IGNORE_RESULT is True


@pytest.mark.slow
def test_each_attempts_task_is_in_celerys_results_and_linked_with_its_run(stack):
    stack.scheduler()
    stack.relay()
    stack.worker(SCHEDULER_CELERY_RESULTS="true")
    job = factories.one_time_job(task="tests.record", args=[7])
    run = wait_for(
        lambda: Run.objects.filter(job=job, state=RunState.SUCCEEDED).first(),
        timeout=60,
        message="the run to succeed",
    )
    attempt = Attempt.objects.get(run=run)
    assert attempt.task_id
    task = wait_for(
        lambda: TaskResult.objects.filter(task_id=attempt.task_id).first(),
        timeout=10,
        message="the task's result",
    )
    assert (task.status, task.task_name) == ("SUCCESS", "tests.record")
    assert str(run.id) in task.task_kwargs and task.worker
    # Celery's own API reads it: AsyncResult on the database backend.
    result = AsyncResult(attempt.task_id, app=app, backend=DatabaseBackend(app=app))
    assert result.state == "SUCCESS"
    assert result.result["run_id"] == str(run.id) and result.result["outcome"] == "succeeded"

    detail = factories.api_client(job.owner).get(f"/api/v1/runs/{run.id}/").json()
    assert detail["attempts"][0]["task_id"] == attempt.task_id
    staff = get_user_model().objects.create_superuser("admin-results", password="pw")
    browser = Client()
    browser.force_login(staff)
    run_page = browser.get(f"/admin/jobs/run/{run.id}/change/").content.decode()
    assert f"/admin/django_celery_results/taskresult/?task_id={attempt.task_id}" in run_page
    task_page = browser.get(f"/admin/django_celery_results/taskresult/{task.id}/change/")
    assert f"/admin/jobs/run/{run.id}/change/" in task_page.content.decode()
    listed = browser.get(f"/admin/django_celery_results/taskresult/?task_id={attempt.task_id}")
    assert listed.status_code == 200 and attempt.task_id in listed.content.decode()
