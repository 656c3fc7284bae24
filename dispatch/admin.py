"""The admin's Celery task results (django-celery-results, filled when
SCHEDULER_CELERY_RESULTS is on) link to the runs their task delivered; a run's attempts
link back to their task (the run page, jobs.admin.pages)."""

import re

from django.contrib import admin
from django.urls import reverse
from django.utils.html import format_html_join
from django_celery_results.admin import TaskResultAdmin
from django_celery_results.models import TaskResult

# A delivery's kwargs name its run (`run_id`) or, packed, its runs (`run_ids`).
RUN_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def task_run_ids(task: TaskResult) -> list[str]:
    """The run ids a task's message carried (its kwargs as Celery's extended result keeps
    them), in order."""
    return list(dict.fromkeys(RUN_ID.findall(task.task_kwargs or "")))


class DeliveryTaskResultAdmin(TaskResultAdmin):
    list_display = (*TaskResultAdmin.list_display, "runs")

    def get_readonly_fields(self, request, obj=None):
        return [*super().get_readonly_fields(request, obj), "runs"]

    def get_fieldsets(self, request, obj=None):
        return [(None, {"fields": ["runs"]}), *super().get_fieldsets(request, obj)]

    @admin.display(description="runs")
    def runs(self, task: TaskResult):
        return format_html_join(
            ", ",
            '<a href="{}">{}</a>',
            ((reverse("admin:jobs_run_change", args=[run_id]), run_id[:8])
             for run_id in task_run_ids(task)),
        ) or "-"  # fmt: skip


admin.site.unregister(TaskResult)
admin.site.register(TaskResult, DeliveryTaskResultAdmin)
