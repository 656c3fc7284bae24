"""Operators browse jobs, runs and attempts here (actions arrive with the lifecycle issue)."""

from django.contrib import admin

from .models import Attempt, AuditEvent, Job, JobVersion, Run


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
    )
    readonly_fields = fields
    can_delete = False


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
