"""The outbox, the effect ledger and durable counters."""

import uuid

from django.db import models
from django.db.models import Q


class OutboxState(models.TextChoices):
    PENDING = "pending"  # written with the state change; the relay moves it to published
    PUBLISHED = "published"  # terminal: the broker confirmed it


class OutboxMessage(models.Model):
    """A task message to publish, committed in the transaction that made it necessary."""

    run = models.ForeignKey("jobs.Run", on_delete=models.CASCADE, related_name="outbox_messages")
    # The Celery task id: the same on every re-publication of this row.
    message_id = models.UUIDField(default=uuid.uuid4, unique=True)
    task_name = models.CharField(max_length=200)
    queue = models.CharField(max_length=100)
    priority = models.PositiveSmallIntegerField(default=0)
    # The job's timeout_seconds: sent as Celery's soft time limit (the hard one a little
    # later), so the worker stops a handler that overruns.
    timeout_seconds = models.PositiveIntegerField(null=True, blank=True)
    state = models.CharField(
        max_length=16, choices=OutboxState.choices, default=OutboxState.PENDING
    )
    created_at = models.DateTimeField()
    published_at = models.DateTimeField(null=True, blank=True)
    publish_tries = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True, default="")

    class Meta:
        indexes = [
            # The relay claims by state, never by `id > last_seen` (rows commit out of order).
            models.Index(fields=["id"], name="outbox_pending_idx", condition=Q(state="pending")),
        ]

    def __str__(self) -> str:
        return f"outbox {self.id} ({self.state})"


class Effect(models.Model):
    """One recorded effect of a run: `with ctx.effect(name)` commits it at most once."""

    run = models.ForeignKey("jobs.Run", on_delete=models.CASCADE, related_name="effects")
    name = models.CharField(max_length=200)
    attempt_number = models.PositiveIntegerField()
    fencing_token = models.PositiveIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["run", "name"], name="effect_once_per_run"),
        ]

    def __str__(self) -> str:
        return f"effect {self.name} of run {self.run_id}"


class Counter(models.Model):
    """A monotonic counter shared by every process, exported on /metrics."""

    name = models.CharField(max_length=200)
    labels = models.CharField(max_length=400, blank=True, default="")
    value = models.BigIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["name", "labels"], name="counter_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.name}{{{self.labels}}} {self.value}"
