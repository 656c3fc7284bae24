"""`job_task`: registers a handler as a real Celery task that the scheduler can run."""

from __future__ import annotations

import os
from collections.abc import Callable

from celery import shared_task

from jobs.registry import task_register


def job_task(name: str, *, pack: int | None = None, **celery_options):
    """Register `handler(ctx, *args, **kwargs)` under `name`.

    `pack`: up to this many due runs travel in one broker message, which one pool process
    runs one after another (each claimed when its turn comes, with its own attempt, lease,
    token and time limit), recording their successes together: fewer messages, task
    dispatches and commits per run. Left out, the relay decides from what the task's
    recent attempts took (dispatch.packing): a short task's runs are packed, a long or
    unknown one's travel alone. `pack=1`: never packed (packed runs wait for the ones
    before them); `pack=N`: always up to N.

    The Celery task it becomes receives only the run id; the worker claims the run, loads
    the job's args and kwargs from the run's version, and calls the handler with a context.
    """

    def decorate(handler: Callable):
        task_register(name=name, handler=handler, pack=pack)

        # shared_task binds to the project's Celery app (scheduler_project.celery) without
        # importing it: the wiring sits above dispatch in the import contract.
        @shared_task(name=name, bind=True, **celery_options)
        def deliver(
            self,
            run_id: str | None = None,
            published_at: str | None = None,
            run_ids: list[str] | None = None,
            timeout_seconds: float | None = None,
        ):
            # Imported at delivery, not at import: task modules (and this one, through
            # `dispatch`) load while Django's apps are still loading, before the models.
            from .worker import PackInterrupted, run_execute_deliveries, run_execute_delivery

            identity = {
                "handler": handler,
                "worker": f"{self.request.hostname or 'worker'}:{os.getpid()}",
                "message_id": self.request.id or "",
                "published_at": published_at,
            }
            if run_ids is None:
                summary = run_execute_delivery(run_id=run_id, **identity)
                retry_with = {}
            else:
                # A packed message carries no Celery soft limit: each run gets its own.
                try:
                    summary = run_execute_deliveries(
                        run_ids=run_ids, time_limit=timeout_seconds, **identity
                    )
                except PackInterrupted as stop:
                    # The runs not reached go back to their queue before the task ends.
                    kwargs = {**self.request.kwargs, "run_ids": stop.remaining}
                    self.retry(kwargs=kwargs, countdown=0, max_retries=None, throw=False)
                    raise stop.__cause__ from None
                retry_with = {"run_ids": summary.get("remaining")}
            if summary["outcome"] == "claim_failed":
                # Acknowledged already and not claimed (the database stayed away): never
                # dropped, the runs not yet claimed go back to their queue in a message
                # of their own, confirmed by the broker.
                kwargs = {**self.request.kwargs, **retry_with}
                self.retry(kwargs=kwargs, countdown=0, max_retries=None)
            return summary

        return deliver

    return decorate
