"""Operators read each attempt's log here: chunk and manifest rows, read-only, and one page
per attempt with its first `ADMIN_MAX_LINES` lines, its error beside them, a live tail while
it runs, and breadcrumbs back to its run and job."""

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html

from jobs.admin import ReadOnlyAdmin
from jobs.models import Attempt, AttemptState

from .models import LogChunk, LogManifest
from .selectors import log_lines

ADMIN_MAX_LINES = 5000  # a page the browser can hold; the API serves the rest


class AttemptLogLink:
    """A list column linking a row with an `attempt` to that attempt's log page."""

    @admin.display(description="log")
    def log_link(self, obj) -> str:
        url = reverse("admin:logs_app_attempt_log", args=[obj.attempt_id])
        return format_html('<a href="{}">view log</a>', url)


@admin.register(LogManifest)
class LogManifestAdmin(AttemptLogLink, ReadOnlyAdmin):
    """Also serves the per-attempt log page (for attempts with or without a manifest)."""

    list_display = (
        "attempt",
        "chunk_count",
        "line_count",
        "byte_count",
        "dropped_lines",
        "created_at",
        "log_link",
    )
    list_select_related = ("attempt",)
    search_fields = ("attempt__run__id",)

    def get_urls(self):
        view = self.admin_site.admin_view(self.attempt_log_view)
        urls = [path("attempt/<int:attempt_id>/", view, name="logs_app_attempt_log")]
        return urls + super().get_urls()

    def attempt_log_view(self, request, attempt_id: int):
        """The attempt's first ADMIN_MAX_LINES lines, its error beside them, and, while it
        runs, a live tail in the browser (static/logs_app/live_tail.js polling the logs API)."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        attempt = get_object_or_404(Attempt.objects.select_related("run__job"), id=attempt_id)
        run = attempt.run
        lines = log_lines(attempt=attempt, after=-1, limit=ADMIN_MAX_LINES + 1)
        shown = lines[:ADMIN_MAX_LINES]
        logs_url = reverse("run-logs", args=[run.id]) + f"?attempt={attempt.number}"
        context = {
            **self.admin_site.each_context(request),
            "title": f"Log of attempt {attempt.number} of run {run.id}",
            "attempt": attempt,
            "run": run,
            "others": Attempt.objects.filter(run=run).exclude(id=attempt.id).order_by("number"),
            "complete": LogManifest.objects.filter(attempt=attempt).exists(),
            "rows": [
                f"{line['n']} {line['ts']} {line['stream']} {line['level']} {line['text']}"
                for line in shown
            ],
            "after": shown[-1]["n"] if shown else -1,
            "follow": attempt.state == AttemptState.RUNNING,
            "logs_url": logs_url,
            "text_url": logs_url + "&format=text",
            "run_url": reverse("run-detail", args=[run.id]),
            "shown": ADMIN_MAX_LINES,
            "truncated": len(lines) > ADMIN_MAX_LINES,
        }
        return TemplateResponse(request, "admin/logs_app/attempt_log.html", context)


@admin.register(LogChunk)
class LogChunkAdmin(AttemptLogLink, ReadOnlyAdmin):
    list_display = (
        "attempt",
        "sequence",
        "first_line",
        "line_count",
        "byte_count",
        "storage_name",
        "created_at",
        "log_link",
    )
    list_select_related = ("attempt",)
    search_fields = ("run__id",)
    exclude = ("content",)  # read through the attempt's log page, not as one raw field
