import importlib

from django.apps import AppConfig
from django.conf import settings


class DispatchConfig(AppConfig):
    name = "dispatch"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Every process (web, scheduler, relay, worker) knows the same registered tasks:
        # the API refuses unknown task names, and the worker consumes them.
        for module in ["dispatch.builtin_tasks", *settings.SCHEDULER_TASK_MODULES]:
            importlib.import_module(module)
