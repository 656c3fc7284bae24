"""Operators browse jobs, runs and attempts here, and act on them through the same
services as the API (each action is audited with its actor)."""

import json

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.urls import reverse
from django.utils.html import format_html

from ..audit import audit_record
from ..clock import db_now
from ..lanes import lanes_of
from ..models import (
    OWNER_LIMIT_STATES,
    ActiveRun,
    ApiToken,
    Attempt,
    AuditEvent,
    Counter,
    Effect,
    Job,
    OutboxMessage,
    OutboxState,
    OwnerLimit,
    QueueControl,
    Run,
)
from ..queues import queue_pause, queue_paused_now, queue_resume
from ..redaction import redact, redact_value
from ..roles import user_is_operator
from ..selectors import jobs_with_last_outcome
from ..services import job_is_editable
from ..tokens import tokens_revoke
from .actions import JOB_ACTIONS, RUN_ACTIONS, action_buttons
from .forms import JobEditing
from .pages import job_page, run_page


def redacted_json(value) -> str:
    """A stored JSON value (spec, args, kwargs, labels, result, audit data) as the admin
    shows it: secret-looking values masked at any depth (jobs.redaction)."""
    return format_html(
        "<pre>{}</pre>", json.dumps(redact_value(value), indent=2, ensure_ascii=False, default=str)
    )


def short_id(obj) -> str:
    """The first 8 characters of the id, the whole one in its title (hover, copy)."""
    return format_html('<code class="short-id" title="{}">{}</code>', obj.pk, str(obj.pk)[:8])


def when(value) -> str:
    """An instant as `2026-12-05 06:37` (UTC), the seconds in its title: one line in a list."""
    if value is None:
        return "-"
    return format_html('<span title="{}">{}</span>', value.isoformat(),
                       value.strftime("%Y-%m-%d %H:%M"))  # fmt: skip


class ReadOnlyAdmin(admin.ModelAdmin):
    """State changes go through jobs.services and jobs.transitions, never through a form."""

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class OperatorPage:
    """A change page showing what `page(obj)` adds (jobs/admin/pages.py) and the buttons of
    the actions this user may take on the object."""

    def page(self, obj) -> dict:
        raise NotImplementedError

    def change_view(self, request, object_id, form_url="", extra_context=None):
        obj = self.get_object(request, object_id)
        if obj is not None:
            extra_context = {**(extra_context or {}), **self.page(obj),
                             "action_buttons": action_buttons(self, request, obj)}  # fmt: skip
        return super().change_view(request, object_id, form_url, extra_context)


@admin.register(Job)
class JobAdmin(OperatorPage, JobEditing, admin.ModelAdmin):
    """Created and edited through the API's validation and services (jobs/admin/forms.py);
    the page shows the schedule in words, next fires, recent runs and history."""

    # Newest first, one line a job at 1280 px; the last outcome beside the state (a
    # completed job whose run failed says so: docs/api.md, "A job's state and its last
    # outcome").
    list_display = ("job_id", "name", "task", "owner", "state", "last_outcome", "next_run",
                    "created")  # fmt: skip
    list_display_links = ("job_id", "name")
    media = forms.Media(css={"all": ["jobs/operator.css"]})
    list_filter = ("state", "queue", "task", ("owner", admin.RelatedOnlyFieldListFilter))
    list_select_related = ("owner",)
    ordering = ("-created_at", "-id")
    search_fields = ("name", "task", "id")
    actions = JOB_ACTIONS
    change_form_template = "admin/jobs/job/change_form.html"
    STATE_FIELDS = ("owner", "state", "version", "next_run_at", "created_at", "updated_at")
    readonly_fields = (*STATE_FIELDS, "body_display")

    def get_fieldsets(self, request, obj=None):
        if obj is None:
            return [(None, {"fields": ["body"]})]
        editable = self.has_change_permission(request, obj)
        body = ["body", "based_on"] if editable else ["body_display"]
        return [(None, {"fields": body}), ("State", {"fields": list(self.STATE_FIELDS)})]

    @admin.display(description="body")
    def body_display(self, job):
        return redacted_json(job.spec)

    def get_queryset(self, request):
        return jobs_with_last_outcome(super().get_queryset(request))

    @admin.display(description="id", ordering="id")
    def job_id(self, job):
        return short_id(job)

    @admin.display(description="last run", ordering="last_run_at")
    def last_outcome(self, job):
        if job.last_run_state is None:
            return "-"
        return format_html('<span class="state state-{}" title="finished {}">{}</span>',
                           job.last_run_state, job.last_run_at.isoformat(),
                           job.last_run_state)  # fmt: skip

    @admin.display(description="next run", ordering="next_run_at")
    def next_run(self, job):
        return when(job.next_run_at)

    @admin.display(description="created", ordering="created_at")
    def created(self, job):
        return when(job.created_at)

    def page(self, job) -> dict:
        return job_page(job=job, now=db_now())

    def has_change_permission(self, request, obj=None):
        # A cancelled, completed or deleted job is shown, not edited (the API answers 409).
        editable = obj is None or job_is_editable(job=obj)
        return editable and super().has_change_permission(request, obj)

    def has_delete_permission(self, request, obj=None):
        return False  # the API's DELETE is a soft delete through job_delete

    # The actions' permissions (jobs/admin/actions.py): the model's custom permissions.
    def has_pause_permission(self, request):
        return request.user.has_perm("jobs.pause_job")

    def has_cancel_permission(self, request):
        return request.user.has_perm("jobs.cancel_job")

    def has_trigger_permission(self, request):
        return request.user.has_perm("jobs.trigger_job")


@admin.register(Run)
class RunAdmin(OperatorPage, ReadOnlyAdmin):
    # Newest first, one line a run at 1280 px.
    list_display = ("run_id", "job_name", "kind", "state", "scheduled", "attempt_count",
                    "failure_reason", "finished")  # fmt: skip
    list_display_links = ("run_id",)
    media = forms.Media(css={"all": ["jobs/operator.css"]})
    list_filter = ("state", "kind", "failure_reason", "job__queue", "job__task",
                   ("job__owner", admin.RelatedOnlyFieldListFilter))  # fmt: skip
    list_select_related = ("job",)
    ordering = ("-created_at", "-id")
    search_fields = ("id", "job__name", "idempotency_key")
    date_hierarchy = "scheduled_for"
    actions = RUN_ACTIONS
    change_form_template = "admin/jobs/run/change_form.html"
    exclude = ("result",)
    readonly_fields = ("shown_result",)

    @admin.display(description="result")
    def shown_result(self, run):
        return redacted_json(run.result)

    @admin.display(description="id", ordering="id")
    def run_id(self, run):
        return short_id(run)

    @admin.display(description="job", ordering="job__name")
    def job_name(self, run):
        url = reverse("admin:jobs_job_change", args=[run.job_id])
        return format_html('<a href="{}" title="{}">{}</a>', url, run.job_id, run.job.name[:60])

    @admin.display(description="scheduled for", ordering="scheduled_for")
    def scheduled(self, run):
        return when(run.scheduled_for)

    @admin.display(description="finished", ordering="finished_at")
    def finished(self, run):
        return when(run.finished_at)

    def page(self, run) -> dict:
        return run_page(run=run)

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
    exclude = ("error",)
    readonly_fields = ("attempt_error",)

    @admin.display(description="error")
    def attempt_error(self, attempt) -> str:
        return redact(attempt.error)


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
    list_display = ("id", "run", "owner", "task_name", "queue", "created_at", "publish_tries")
    list_filter = ("queue",)


WAITING_RUNS_SHOWN = 1000  # an owner's waiting runs counted up to this in the limits' list


@admin.register(OwnerLimit)
class OwnerLimitAdmin(admin.ModelAdmin):
    """An owner's own limit of runs in the broker or running at once, instead of
    SCHEDULER_OWNER_MAX_ACTIVE_RUNS (empty: unlimited); each change audited. Operators only
    (the operators group, superusers), whatever their model permissions."""

    list_display = ("owner", "max_active_runs", "active_runs", "waiting_runs", "updated_at")
    search_fields = ("owner__username",)
    raw_id_fields = ("owner",)

    def has_module_permission(self, request):
        return user_is_operator(request.user)

    def has_view_permission(self, request, obj=None):
        return user_is_operator(request.user)

    has_add_permission = has_change_permission = has_delete_permission = has_view_permission

    @admin.display(description="in the broker or running")
    def active_runs(self, limit):
        return ActiveRun.objects.filter(
            owner_id=limit.owner_id, run__state__in=OWNER_LIMIT_STATES
        ).count()

    @admin.display(description="waiting to be published")
    def waiting_runs(self, limit):
        # Counted up to a cap: an owner's backlog waiting on purpose may be very long.
        waiting = OutboxMessage.objects.filter(owner_id=limit.owner_id, state=OutboxState.PENDING)
        count = waiting[: WAITING_RUNS_SHOWN + 1].count()
        return f"{WAITING_RUNS_SHOWN}+" if count > WAITING_RUNS_SHOWN else count

    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        limit = {"owner": obj.owner_id, "max_active_runs": obj.max_active_runs}
        audit_record(action="owner.limit_set", actor=request.user, data=limit)

    def delete_model(self, request, obj):
        audit_record(action="owner.limit_removed", actor=request.user,
                     data={"owner": obj.owner_id})  # fmt: skip
        super().delete_model(request, obj)


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


@admin.register(QueueControl)
class QueueControlAdmin(ReadOnlyAdmin):
    """Every configured queue (its lanes with it): paused or not, its cap and rate, the runs
    waiting in PostgreSQL; `pause_queues` and `resume_queues` as the API's pause and resume
    (audited, the operator the actor). Operators only. Caps and rates are set through
    `PATCH /api/v1/queues/{name}/`."""

    list_display = ("name", "paused_now", "paused_reason", "paused_until", "max_running",
                    "rate_limit", "waiting_runs")  # fmt: skip
    actions = ["pause_queues", "resume_queues"]

    def has_module_permission(self, request):
        return user_is_operator(request.user)

    def has_view_permission(self, request, obj=None):
        return user_is_operator(request.user)

    def changelist_view(self, request, extra_context=None):
        # A configured queue has a row here from its first look, free until an operator acts.
        for name in settings.SCHEDULER_QUEUES:
            QueueControl.objects.get_or_create(name=name)
        return super().changelist_view(request, extra_context)

    @admin.display(description="paused", boolean=True)
    def paused_now(self, control):
        return queue_paused_now(control, now=db_now())

    @admin.display(description="waiting in PostgreSQL")
    def waiting_runs(self, control):
        names = [control.name, *lanes_of(control.name)]
        return OutboxMessage.objects.filter(queue__in=names, state=OutboxState.PENDING).count()

    @admin.action(description="Pause the selected queues")
    def pause_queues(self, request, queryset):
        now = db_now()
        names = list(queryset.values_list("name", flat=True))
        for name in names:
            queue_pause(name=name, actor=request.user, reason="paused in the admin", until=None,
                        now=now)  # fmt: skip
        self.message_user(request, f"Paused {len(names)} queues: {', '.join(names)}.")

    @admin.action(description="Resume the selected queues")
    def resume_queues(self, request, queryset):
        names = list(queryset.values_list("name", flat=True))
        for name in names:
            queue_resume(name=name, actor=request.user)
        self.message_user(request, f"Resumed {len(names)} queues: {', '.join(names)}.")
