"""`job_task`: registers a handler as a real Celery task that the scheduler can run."""

from __future__ import annotations

import os
from collections.abc import Callable

from jobs.registry import task_register
from scheduler_project.celery import app


def job_task(name: str, **celery_options):
    """Register `handler(ctx, *args, **kwargs)` under `name`.

    The Celery task it becomes receives only the run id; the worker claims the run, loads
    the job's args and kwargs from the run's version, and calls the handler with a context.
    """

    def decorate(handler: Callable):
        task_register(name=name, handler=handler)

        @app.task(name=name, bind=True, **celery_options)
        def deliver(self, run_id: str, published_at: str | None = None):
            # `published_at`: sent by the relay (dispatch.relay), recorded by the claim.
            # Imported at delivery, not at import: task modules (and this one, through
            # `dispatch`) load while Django's apps are still loading, before the models.
            from .runtime import run_execute_delivery

            return run_execute_delivery(
                run_id=run_id,
                handler=handler,
                worker=f"{self.request.hostname or 'worker'}:{os.getpid()}",
                message_id=self.request.id or "",
                published_at=published_at,
            )

        return deliver

    return decorate
