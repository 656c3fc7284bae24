"""The Celery app. Workers: `celery -A scheduler_project worker`."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "scheduler_project.settings.base")

app = Celery("scheduler_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
# Client task modules (SCHEDULER_TASK_MODULES) are imported by dispatch's AppConfig.ready,
# which Celery's Django fix-up runs in every worker before it consumes.
