"""Operators browse jobs, runs and attempts here, and act on them through the same
services as the API (each action is audited with its actor)."""

from django.contrib import admin, messages
from django.urls import reverse
from django.utils.html import format_html

from .clock import db_now
from .models import Attempt, AuditEvent, Counter, Effect, Job, JobVersion, OutboxMessage, Run
from .services import job_cancel, run_cancel_request, run_replay_request


def _act(modeladmin, request, queryset, action, verb: str) -> None:
    """Apply `action(obj)` to each selected object; report how many it changed."""
    done = sum(bool(action(obj)) for obj in queryset[:1000])
    refused = min(queryset.count(), 1000) - done
    modeladmin.message_user(request, f"{verb}: {done}; refused (illegal in their state): {refused}",
                            messages.SUCCESS if not refused else messages.WARNING)  # fmt: skip


class ReadOnlyAdmin(admin.ModelAdmin):
    """State changes go through jobs.services and jobs.transitions, never through a form."""

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class JobVersionInline(admin.TabularInline):
    model = JobVersion
    extra = 0
    fields = ("version", "created_at", "created_by", "spec")
    readonly_fields = fields
    can_delete = False


@admin.register(Job)
class JobAdmin(ReadOnlyAdmin):
    list_display = ("name", "task", "owner", "state", "version", "next_run_at", "created_at")
    list_filter = ("state", "task", "queue")
    search_fields = ("name", "task", "id")
    inlines = [JobVersionInline]
    actions = ["cancel_jobs"]

    @admin.action(description="Cancel the selected jobs (and their active runs)")
    def cancel_jobs(self, request, queryset):
        _act(self, request, queryset,
             lambda job: job_cancel(job=job, actor=request.user, now=db_now()),
             "cancelled")  # fmt: skip


class AttemptInline(admin.TabularInline):
    model = Attempt
    extra = 0
    fields = (
        "number",
        "state",
        "fencing_token",
        "worker",
        "started_at",
        "heartbeat_at",
        "lease_expires_at",
        "finished_at",
        "error",
        "logs",
        "task",
    )
    readonly_fields = fields
    can_delete = False

    @admin.display(description="Celery task")
    def task(self, attempt):
        # Its TaskResult (django-celery-results) when SCHEDULER_CELERY_RESULTS is on.
        if not attempt.task_id:
            return "-"
        url = reverse("admin:django_celery_results_taskresult_changelist")
        return format_html('<a href="{}?task_id={}">{}</a>', url, attempt.task_id, attempt.task_id)

    @admin.display(description="logs")
    def logs(self, attempt):
        url = reverse("admin:logs_app_attempt_log", args=[attempt.id])
        return format_html('<a href="{}">view</a>', url)


@admin.register(Run)
class RunAdmin(ReadOnlyAdmin):
    list_display = (
        "id",
        "job",
        "kind",
        "state",
        "scheduled_for",
        "attempt_count",
        "failure_reason",
        "duplicate_deliveries",
        "finished_at",
    )
    list_filter = ("state", "kind", "failure_reason")
    search_fields = ("id", "job__name", "idempotency_key")
    date_hierarchy = "scheduled_for"
    inlines = [AttemptInline]
    actions = ["cancel_runs", "replay_runs"]

    @admin.action(description="Cancel the selected runs")
    def cancel_runs(self, request, queryset):
        _act(self, request, queryset,
             lambda run: run_cancel_request(run=run, actor=request.user, now=db_now()),
             "cancelled")  # fmt: skip

    @admin.action(description="Replay the selected failed or cancelled runs")
    def replay_runs(self, request, queryset):
        _act(self, request, queryset.select_related("job_version"),
             lambda run: run_replay_request(run=run, actor=request.user, now=db_now()),
             "replayed")  # fmt: skip


@admin.register(Attempt)
class AttemptAdmin(ReadOnlyAdmin):
    list_display = (
        "run",
        "number",
        "state",
        "fencing_token",
        "worker",
        "started_at",
        "finished_at",
    )
    list_filter = ("state",)


@admin.register(AuditEvent)
class AuditEventAdmin(ReadOnlyAdmin):
    list_display = ("created_at", "actor_label", "action", "job", "run")
    list_filter = ("action",)


@admin.register(OutboxMessage)
class OutboxMessageAdmin(ReadOnlyAdmin):
    # Only pending rows exist: the relay deletes a row once the broker confirmed it.
    list_display = ("id", "run", "task_name", "queue", "created_at", "publish_tries")
    list_filter = ("queue",)


@admin.register(Effect)
class EffectAdmin(ReadOnlyAdmin):
    list_display = ("run", "name", "attempt_number", "fencing_token", "created_at")


@admin.register(Counter)
class CounterAdmin(ReadOnlyAdmin):
    list_display = ("name", "labels", "value")
