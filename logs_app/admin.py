"""Operators read each attempt's log here: chunk and manifest rows, read-only, and one page
per attempt rendering its first `ADMIN_MAX_LINES` lines as text."""

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.shortcuts import get_object_or_404
from django.template import engines
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html

from jobs.admin import ReadOnlyAdmin
from jobs.models import Attempt

from .models import LogChunk, LogManifest
from .selectors import log_lines

ADMIN_MAX_LINES = 5000  # a page the browser can hold; the API serves the rest

PAGE = """{% extends "admin/base_site.html" %}
{% block content %}
<p>Run {{ attempt.run_id }}, attempt {{ attempt.number }} ({{ attempt.state }}),
fencing token {{ attempt.fencing_token }}.
{% if complete %}Complete: the attempt's manifest is stored.{% else %}Incomplete: no
manifest (the attempt is running, or ended without its worker).{% endif %}</p>
{% if truncated %}<p><strong>Showing the first {{ shown }} lines only.</strong> The whole
log: GET /api/v1/runs/{{ attempt.run_id }}/logs/?attempt={{ attempt.number }}&amp;format=text
</p>{% endif %}
<pre style="white-space: pre-wrap">{% for row in rows %}{{ row }}
{% empty %}(no lines){% endfor %}</pre>
{% endblock %}
"""


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
        if not self.has_view_permission(request):
            raise PermissionDenied
        attempt = get_object_or_404(Attempt, id=attempt_id)
        lines = log_lines(attempt=attempt, after=-1, limit=ADMIN_MAX_LINES + 1)
        context = {
            **self.admin_site.each_context(request),
            "title": f"Log of attempt {attempt.number} of run {attempt.run_id}",
            "attempt": attempt,
            "complete": LogManifest.objects.filter(attempt=attempt).exists(),
            "rows": [
                f"{line['n']} {line['ts']} {line['stream']} {line['level']} {line['text']}"
                for line in lines[:ADMIN_MAX_LINES]
            ],
            "shown": ADMIN_MAX_LINES,
            "truncated": len(lines) > ADMIN_MAX_LINES,
        }
        return TemplateResponse(request, engines["django"].from_string(PAGE), context)


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
