"""Calendars in the admin: created and edited through the API's validation and the same
services (a new version, audited, and the jobs that name it moved); the page lists those
jobs."""

from __future__ import annotations

from django import forms
from django.contrib import admin
from django.urls import reverse
from django.utils.html import format_html, format_html_join

from ..calendar_services import calendar_create, calendar_jobs, calendar_update
from ..calendars import CalendarError, calendar_spec_check
from ..clock import db_now
from ..models import Calendar
from .forms import JobBodyField

EXAMPLE_SPEC = {
    "timezone": "Europe/Berlin",
    "dates": ["2026-12-31"],
    "ranges": [{"start": "2026-12-24T18:00", "end": "2026-12-27T06:00", "name": "freeze"}],
    "rrules": ["FREQ=YEARLY;BYMONTH=5;BYMONTHDAY=1"],
    "holidays": {"country": "DE", "subdivision": "BY"},
}


class CalendarForm(forms.ModelForm):
    body = JobBodyField(
        help_text="timezone, dates, ranges (local times), rrules, holidays: as "
        "POST /api/v1/calendars/ takes them.",
        widget=forms.Textarea(attrs={"rows": 20, "cols": 100, "spellcheck": "false"}),
    )

    class Meta:
        model = Calendar
        fields = ["name"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        adding = self.instance._state.adding
        self.fields["body"].initial = EXAMPLE_SPEC if adding else self.instance.spec
        self.spec: dict | None = None

    def clean(self):
        data = super().clean()
        if "body" in data:
            try:
                self.spec = calendar_spec_check(data["body"])
            except CalendarError as exc:
                self.add_error("body", f"{exc.field}: {exc}")
        return data


@admin.register(Calendar)
class CalendarAdmin(admin.ModelAdmin):
    form = CalendarForm
    list_display = ("name", "owner", "version", "updated_at")
    search_fields = ("name", "id")
    readonly_fields = ("owner", "version", "created_at", "updated_at", "jobs_naming_it")

    def get_queryset(self, request):
        return super().get_queryset(request).filter(deleted_at=None)

    def get_fields(self, request, obj=None):
        if obj is None:
            return ["name", "body"]
        return ["name", "body", "owner", "version", "updated_at", "jobs_naming_it"]

    @admin.display(description="jobs naming it")
    def jobs_naming_it(self, calendar):
        jobs = calendar_jobs(calendar=calendar)[:200]
        if not jobs:
            return "none"
        return format_html(
            "<ul>{}</ul>",
            format_html_join(
                "", '<li><a href="{}">{}</a> ({})</li>',
                ((reverse("admin:jobs_job_change", args=[job.id]), job.name, job.state)
                 for job in jobs),
            ),
        )  # fmt: skip

    def save_model(self, request, obj, form, change):
        now = db_now()
        if not change:
            created = calendar_create(owner=request.user, name=obj.name, spec=form.spec, now=now)
            obj.id = created.id
        else:
            stored = Calendar.objects.get(id=obj.id)
            calendar_update(
                calendar=stored,
                name=obj.name,
                spec=form.spec,
                expected_version=stored.version,
                actor=request.user,
                now=now,
            )
        obj.refresh_from_db()
        obj._state.adding = False

    def has_delete_permission(self, request, obj=None):
        return False  # DELETE /api/v1/calendars/{id}/ refuses while live jobs name it
