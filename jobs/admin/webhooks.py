"""Webhooks and their deliveries in the admin, read-only: the owners manage their webhooks
through the API (the secret is shown once, there); operators see what was posted, each
attempt's answer and the next retry."""

from django.contrib import admin
from django.db import models

from ..models import Webhook, WebhookAttempt, WebhookDelivery
from .model_admins import ReadOnlyAdmin


@admin.register(Webhook)
class WebhookAdmin(ReadOnlyAdmin):
    list_display = ("url", "owner", "events", "jobs", "created_at")
    list_filter = ("owner",)
    search_fields = ("url", "owner__username")
    exclude = ("secret",)  # never shown again after its creation
    formfield_overrides = {models.URLField: {"assume_scheme": "https"}}


class WebhookAttemptInline(admin.TabularInline):
    model = WebhookAttempt
    fields = ("number", "started_at", "finished_at", "status_code", "error")
    readonly_fields = fields
    extra = 0
    can_delete = False
    ordering = ("number",)

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(WebhookDelivery)
class WebhookDeliveryAdmin(ReadOnlyAdmin):
    list_display = (
        "id",
        "event",
        "state",
        "webhook",
        "attempt_count",
        "last_status_code",
        "next_attempt_at",
        "created_at",
    )
    list_filter = ("state", "event")
    search_fields = ("id", "job_id", "run_id", "webhook__url")
    ordering = ("-created_at",)
    list_select_related = ("webhook",)
    inlines = [WebhookAttemptInline]
