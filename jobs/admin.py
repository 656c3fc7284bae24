"""Operators browse jobs, runs and attempts here, and act on them through the same
services as the API (each action is audited with its actor)."""

import json

from django.contrib import admin, messages
from django.urls import reverse
from django.utils.html import format_html

from .clock import db_now
from .models import (
    ApiToken,
    Attempt,
    AuditEvent,
    Counter,
    Effect,
    Job,
    JobVersion,
    OutboxMessage,
    Run,
)
from .redaction import redact, redact_value
from .services import job_cancel, run_cancel_request, run_replay_request
from .tokens import tokens_revoke


def _act(modeladmin, request, queryset, action, verb: str) -> None:
    """Apply `action(obj)` to each selected object; report how many it changed."""
    done = sum(bool(action(obj)) for obj in queryset[:1000])
    refused = min(queryset.count(), 1000) - done
    modeladmin.message_user(request, f"{verb}: {done}; refused (illegal in their state): {refused}",
                            messages.SUCCESS if not refused else messages.WARNING)  # fmt: skip


def redacted_json(value) -> str:
    """A stored JSON value (spec, args, kwargs, labels, result, audit data) as the admin
    shows it: secret-looking values masked at any depth (jobs.redaction)."""
    return format_html("<pre>{}</pre>", json.dumps(redact_value(value), indent=2, default=str))


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
    fields = ("version", "created_at", "created_by", "shown_spec")
    readonly_fields = fields
    can_delete = False

    @admin.display(description="spec")
    def shown_spec(self, version):
        return redacted_json(version.spec)


@admin.register(Job)
class JobAdmin(ReadOnlyAdmin):
    list_display = ("name", "task", "owner", "state", "version", "next_run_at", "created_at")
    list_filter = ("state", "task", "queue")
    search_fields = ("name", "task", "id")
    inlines = [JobVersionInline]
    actions = ["cancel_jobs"]
    exclude = ("spec", "labels")
    readonly_fields = ("shown_spec", "shown_labels")

    @admin.display(description="spec")
    def shown_spec(self, job):
        return redacted_json(job.spec)

    @admin.display(description="labels")
    def shown_labels(self, job):
        return redacted_json(job.labels)

    @admin.action(description="Cancel the selected jobs (and their active runs)")
    def cancel_jobs(self, request, queryset):
        _act(self, request, queryset,
             lambda job: job_cancel(job=job, actor=request.user, now=db_now()),
             "cancelled")  # fmt: skip


@admin.display(description="error")
def attempt_error(attempt) -> str:
    return redact(attempt.error)


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
        attempt_error,
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
    actions = ["cancel_runs", "replay_runs"]
    exclude = ("result",)
    readonly_fields = ("shown_result",)

    @admin.display(description="result")
    def shown_result(self, run):
        return redacted_json(run.result)

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
    exclude = ("error",)
    readonly_fields = (attempt_error,)


@admin.register(AuditEvent)
class AuditEventAdmin(ReadOnlyAdmin):
    list_display = ("created_at", "actor_label", "action", "job", "run")
    list_filter = ("action",)
    exclude = ("data",)
    readonly_fields = ("shown_data",)

    @admin.display(description="data")
    def shown_data(self, event):
        return redacted_json(event.data)


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


@admin.register(ApiToken)
class ApiTokenAdmin(ReadOnlyAdmin):
    """Owner, prefix, creation and expiry; never the key (only its hash is stored, and not
    shown either). New tokens: `manage.py drf_create_token <user>`."""

    list_display = ("prefix", "owner", "name", "created_at", "expires_at", "revoked_at")
    list_filter = ("revoked_at",)
    search_fields = ("prefix", "owner__username", "name")
    exclude = ("digest",)
    actions = ["revoke_tokens"]

    def has_revoke_permission(self, request) -> bool:
        return request.user.has_perm("jobs.change_apitoken")

    @admin.action(description="Revoke the selected tokens", permissions=["revoke"])
    def revoke_tokens(self, request, queryset):
        revoked = tokens_revoke(tokens=queryset, now=db_now())
        self.message_user(request, f"revoked: {revoked}", messages.SUCCESS)
