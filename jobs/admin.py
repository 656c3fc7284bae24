"""Operators browse jobs, runs and attempts here, and act on them through the same
services as the API (each action is audited with its actor)."""

from django.contrib import admin
from django.urls import reverse
from django.utils.html import format_html

from .admin_actions import JOB_ACTIONS, RUN_ACTIONS
from .models import Attempt, AuditEvent, Counter, Effect, Job, JobVersion, OutboxMessage, Run


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
    actions = JOB_ACTIONS

    # The actions' permissions (jobs/admin_actions.py): the model's custom permissions.
    def has_pause_permission(self, request):
        return request.user.has_perm("jobs.pause_job")

    def has_cancel_permission(self, request):
        return request.user.has_perm("jobs.cancel_job")

    def has_trigger_permission(self, request):
        return request.user.has_perm("jobs.trigger_job")


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
    )
    readonly_fields = fields
    can_delete = False

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
    actions = RUN_ACTIONS

    def has_cancel_permission(self, request):
        return request.user.has_perm("jobs.cancel_run")

    def has_replay_permission(self, request):
        return request.user.has_perm("jobs.replay_run")


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
