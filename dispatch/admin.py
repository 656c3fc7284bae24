from django.contrib import admin

from jobs.admin import ReadOnlyAdmin

from .models import Counter, Effect, OutboxMessage


@admin.register(OutboxMessage)
class OutboxMessageAdmin(ReadOnlyAdmin):
    list_display = ("id", "run", "task_name", "queue", "state", "created_at", "published_at")
    list_filter = ("state", "queue")


@admin.register(Effect)
class EffectAdmin(ReadOnlyAdmin):
    list_display = ("run", "name", "attempt_number", "fencing_token", "created_at")


@admin.register(Counter)
class CounterAdmin(ReadOnlyAdmin):
    list_display = ("name", "labels", "value")
