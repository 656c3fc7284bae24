"""Creating and editing a job from the admin, through the API's validation and services.

The form holds the job body as the API takes it (JSON). A new job is validated by
`job_spec_check` and written by `job_create`, exactly as `POST /api/v1/jobs/`; an edit is
`PATCH /api/v1/jobs/{id}/` with `If-Match` set to the version the page showed:
`job_patched_spec` then `job_update`, a conditional update that a concurrent edit makes
fail. A bad body re-renders the page with HTTP 400 and each field's message.
"""

from __future__ import annotations

import json

from django import forms
from django.contrib import messages
from django.http import HttpResponseRedirect
from django.template.response import TemplateResponse
from rest_framework import serializers

from storage.dependencies import dependency_graph_lock

from ..api.refusals import refusal
from ..api.validation import dependencies_check, job_patched_spec, job_spec_check
from ..calendar_services import job_calendars_check
from ..calendars import CalendarRefused
from ..clock import db_now
from ..dependencies import DependencyCycle, is_dependent
from ..models import Job
from ..redaction import redact_value, unmask
from ..registry import registered_task_names
from ..selectors import job_list
from ..services import JobQuotaExceeded, job_create, job_is_editable, job_quota_check, job_update

EXAMPLE_BODY = {
    "name": "morning report",
    "task": "scheduler.echo",
    "kwargs": {"message": "good morning"},
    "schedule": {"kind": "cron", "expression": "0 9 * * MON-FRI", "timezone": "Europe/Berlin"},
}


def validation_messages(detail, path: str = "") -> list[str]:
    """A DRF ValidationError's detail as `field.subfield: message` lines."""
    if isinstance(detail, dict):
        return [line for field, inner in detail.items()
                for line in validation_messages(inner, _joined(path, field))]  # fmt: skip
    if isinstance(detail, list):
        return [line for item in detail for line in validation_messages(item, path)]
    return [f"{path}: {detail}" if path else str(detail)]


def _joined(path: str, field) -> str:
    if field == "non_field_errors":
        return path
    return f"{path}.{field}" if path else str(field)


class JobBodyField(forms.JSONField):
    def prepare_value(self, value):
        if isinstance(value, forms.fields.InvalidJSONInput):
            return value
        return json.dumps(value, indent=2, ensure_ascii=False)


class JobBodyForm(forms.ModelForm):
    body = JobBodyField(
        widget=forms.Textarea(attrs={"rows": 28, "cols": 100, "class": "vLargeTextField",
                                     "spellcheck": "false"}),
    )  # fmt: skip
    based_on = forms.IntegerField(widget=forms.HiddenInput, required=False)

    class Meta:
        model = Job
        fields: list[str] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        tasks = ", ".join(sorted(registered_task_names())) or "none"
        body = self.fields["body"]
        if self.instance._state.adding:
            body.initial = EXAMPLE_BODY
            body.help_text = (
                "The job body as POST /api/v1/jobs/ takes it, validated by the same rules; "
                f"the job's owner is you. Registered tasks: {tasks}."
            )
        else:
            # Shown with its secrets masked: left as shown, they are kept (jobs.redaction).
            body.initial = redact_value(self.instance.spec)
            self.fields["based_on"].initial = self.instance.version
            body.help_text = (
                "The job body as PATCH /api/v1/jobs/{id}/ takes it: a field left out keeps "
                "its value, a nested object (schedule, retry...) is given whole. Saving "
                f"makes a new version. Registered tasks: {tasks}."
            )
        self.spec: dict | None = None

    def clean(self):
        data = super().clean()
        if "body" not in data:
            return data
        job = self.instance
        try:
            if job._state.adding:
                self.spec, _ = job_spec_check(data["body"], now=db_now())
                dependencies_check(spec=self.spec, visible=job_list(user=self.owner))
                job_quota_check(owner=self.owner, adding=1)  # as the API answers 429
                job_calendars_check(jobs=[Job(owner_id=self.owner.pk, spec=self.spec)])
                return data
            if not job_is_editable(job=job):
                raise forms.ValidationError(refusal("job.change", state=job.state))
            if data.get("based_on") != job.version:
                raise forms.ValidationError(_moved_on(job))
            self.spec = job_patched_spec(spec=job.spec, patch=unmask(data["body"], job.spec))
            job_calendars_check(jobs=[Job(id=job.id, owner_id=job.owner_id, spec=self.spec)])
            if is_dependent(self.spec):
                # The admin checks and saves in one transaction: with the graph's lock taken
                # here, a concurrent edit that closes a cycle with this one has committed
                # (and is seen by the check) or waits for this one.
                dependency_graph_lock()
            dependencies_check(spec=self.spec, visible=job_list(user=self.owner), job_id=job.id)
        except serializers.ValidationError as exc:
            for line in validation_messages(exc.detail):
                self.add_error("body", line)
        except JobQuotaExceeded as exc:
            self.add_error("body", str(exc))
        except CalendarRefused as exc:
            self.add_error("body", f"calendars: {exc}")
        return data


def _moved_on(job: Job) -> str:
    return (
        f"The job is at version {job.version} now, not the one this page showed: reload the "
        "page and make the change again."
    )


class JobEditing:
    """ModelAdmin methods that write a job through the services, not through `save()`."""

    form = JobBodyForm

    def get_form(self, request, obj=None, **kwargs):
        form = super().get_form(request, obj, **kwargs)  # a new class for each request
        form.owner = request.user  # a job added here is its author's
        return form

    def save_model(self, request, obj, form, change):
        now = db_now()
        if not change:
            created = job_create(owner=request.user, spec=form.spec, now=now)
            obj.id = created.id
        else:
            try:
                updated = job_update(job=obj, spec=form.spec, actor=request.user, now=now,
                                     expected_version=form.cleaned_data["based_on"])  # fmt: skip
            except DependencyCycle:  # rolled back whole; the form's check holds the lock first
                updated, obj.edit_refused = False, "it would make a cycle with a concurrent edit."
            if not updated and not getattr(obj, "edit_refused", None):
                obj.refresh_from_db()
                obj.edit_refused = (
                    refusal("job.change", state=obj.state)
                    if not job_is_editable(job=obj)
                    else _moved_on(obj)
                )
        obj.refresh_from_db()
        obj._state.adding = False

    def save_related(self, request, form, formsets, change):
        """Nothing: a job's versions are written by job_create and job_update."""

    def log_change(self, request, obj, message):
        if not getattr(obj, "edit_refused", None):
            super().log_change(request, obj, message)

    def response_change(self, request, obj):
        refused = getattr(obj, "edit_refused", None)
        if refused:  # lost a race with another edit after the form was checked
            self.message_user(request, f"Nothing was changed: {refused}", messages.ERROR)
            return HttpResponseRedirect(request.path)
        return super().response_change(request, obj)

    def changeform_view(self, request, object_id=None, form_url="", extra_context=None):
        response = super().changeform_view(request, object_id, form_url, extra_context)
        if (
            request.method == "POST"
            and isinstance(response, TemplateResponse)
            and response.context_data.get("errors")
        ):
            response.status_code = 400  # bad input, as the API answers it
        return response
