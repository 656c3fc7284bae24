"""The admin's actions on jobs and runs, by their documented names (`pause_jobs`, `resume_jobs`,
`cancel_jobs`, `trigger_jobs`, `backfill_jobs`, `cancel_runs`, `replay_runs`).

Each goes through the service the API calls, with the operator as the actor of its audit
event, and reports honest counts: the selection is read once, before anything changes, and
every refusal says why (the API's 409 wording, `jobs.api.refusals`). Each action needs its
model permission (`jobs.pause_job` ..., see the models' Meta), checked by the admin.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from collections.abc import Callable

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.http import HttpResponseRedirect
from django.template.response import TemplateResponse
from django.utils.http import url_has_allowed_host_and_scheme
from rest_framework import serializers

from ..api.refusals import refusal, schedule_refusal
from ..api.validation import BackfillSerializer, backfill_instants
from ..clock import db_now
from ..models import Job
from ..operations import operation_create
from ..schedules import ScheduleError
from ..services import (
    job_backfill,
    job_cancel,
    job_pause,
    job_resume,
    job_trigger,
    run_cancel_request,
    run_replay_request,
)
from ..transitions import action_possible
from .forms import validation_messages

# One action acts on at most this many objects; a larger selection changes nothing.
MAX_SELECTED = 1000
# A refusal names at most this many of the objects it refused.
NAMED_PER_REFUSAL = 5

# act(request, obj, now) -> None when the action was done, else the reason it was refused.
Act = Callable[[object, object, dt.datetime], str | None]


def _label(obj) -> str:
    return f"'{obj.name}'" if isinstance(obj, Job) else f"run {str(obj.id)[:8]}"


def _back(request) -> HttpResponseRedirect | None:
    """Where the action was asked from (a job's or a run's page posts `next`); None: the
    list, as the admin does by default."""
    target = request.POST.get("next", "")
    if target and url_has_allowed_host_and_scheme(
        target, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        return HttpResponseRedirect(target)
    return None


def _selection(modeladmin, request, queryset) -> list | None:
    """The selected objects, read once; None (and an error message) past MAX_SELECTED."""
    selected = list(queryset[: MAX_SELECTED + 1])
    if len(selected) > MAX_SELECTED:
        noun = modeladmin.opts.verbose_name_plural
        modeladmin.message_user(
            request,
            f"Select at most {MAX_SELECTED} {noun} at a time (more were selected); "
            "nothing was changed.",
            messages.ERROR,
        )
        return None
    return selected


def _report(modeladmin, request, *, verb: str, selected: list, refused: dict, extra="") -> None:
    """`Paused 2 of 3 selected jobs. Refused 1: <reason> ('a').` as one message."""
    noun = modeladmin.opts.verbose_name_plural
    done = len(selected) - sum(len(labels) for labels in refused.values())
    parts = [f"{verb} {done} of {len(selected)} selected {noun}{extra}."]
    for reason, labels in refused.items():
        named = ", ".join(labels[:NAMED_PER_REFUSAL])
        if len(labels) > NAMED_PER_REFUSAL:
            named += f" and {len(labels) - NAMED_PER_REFUSAL} more"
        parts.append(f"Refused {len(labels)}: {reason} ({named}).")
    level = messages.WARNING if refused else messages.SUCCESS
    modeladmin.message_user(request, " ".join(parts), level)


# The admin's actions that, on "select all N", become a bulk operation (jobs.operations).
BULK_ACTIONS = {"pause_jobs": "jobs.pause", "resume_jobs": "jobs.resume",
                "cancel_jobs": "jobs.cancel", "cancel_runs": "runs.cancel",
                "replay_runs": "runs.replay"}  # fmt: skip


def _all_matching(modeladmin, request, queryset):
    """ "Select all N" on a list: first a page showing N, then, once confirmed, one bulk
    operation over the N (frozen), worked in batches by the relays."""
    action = request.POST.get("action", "")
    title = dict(modeladmin.get_action_choices(request)).get(action, action)
    if "confirm" not in request.POST:
        context = {
            **modeladmin.admin_site.each_context(request),
            "title": title,
            "opts": modeladmin.opts,
            "matched": queryset.count(),
            "action": action,
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(request, "admin/jobs/bulk_confirm.html", context)
    operation = operation_create(user=request.user, action=BULK_ACTIONS[action],
                                 targets=queryset, stored_filter={"admin": request.GET.urlencode()},
                                 now=db_now())  # fmt: skip
    modeladmin.message_user(
        request,
        f"Started operation {operation.id} on all {operation.matched} "
        f"{modeladmin.opts.verbose_name_plural}; it goes on in the background.",
        messages.SUCCESS,
    )
    return None


def _apply(modeladmin, request, queryset, act: Act, verb: str):
    if request.POST.get("select_across") == "1" and request.POST.get("action") in BULK_ACTIONS:
        return _all_matching(modeladmin, request, queryset)
    selected = _selection(modeladmin, request, queryset)
    if selected is not None:
        now = db_now()
        refused = defaultdict(list)
        for obj in selected:
            reason = act(request, obj, now)
            if reason is not None:
                refused[reason].append(_label(obj))
        _report(modeladmin, request, verb=verb, selected=selected, refused=refused)
    return _back(request)


def _by_service(service, action: str) -> Act:
    """An act calling `service(<job or run>=obj, actor, now)`, whose falsy result is a
    refusal in the object's state as read after it."""
    keyword = action.split(".")[0]

    def act(request, obj, now):
        if service(**{keyword: obj}, actor=request.user, now=now):
            return None
        obj.refresh_from_db(fields=["state"])
        return refusal(action, state=obj.state)

    return act


def _resume(request, job, now):
    try:
        return _by_service(job_resume, "job.resume")(request, job, now)
    except ScheduleError as exc:
        return schedule_refusal(exc)


@admin.action(description="Pause the selected jobs", permissions=["pause"])
def pause_jobs(modeladmin, request, queryset):
    return _apply(modeladmin, request, queryset, _by_service(job_pause, "job.pause"), "Paused")


@admin.action(description="Resume the selected jobs", permissions=["pause"])
def resume_jobs(modeladmin, request, queryset):
    return _apply(modeladmin, request, queryset, _resume, "Resumed")


@admin.action(description="Cancel the selected jobs and their active runs", permissions=["cancel"])
def cancel_jobs(modeladmin, request, queryset):
    return _apply(modeladmin, request, queryset, _by_service(job_cancel, "job.cancel"), "Cancelled")


@admin.action(description="Trigger a run of each selected job now", permissions=["trigger"])
def trigger_jobs(modeladmin, request, queryset):
    return _apply(
        modeladmin, request, queryset, _by_service(job_trigger, "job.trigger"), "Triggered"
    )


@admin.action(description="Cancel the selected runs", permissions=["cancel"])
def cancel_runs(modeladmin, request, queryset):
    return _apply(modeladmin, request, queryset, _by_service(run_cancel_request, "run.cancel"),
                  "Cancelled")  # fmt: skip


@admin.action(description="Replay the selected failed or cancelled runs", permissions=["replay"])
def replay_runs(modeladmin, request, queryset):
    act = _by_service(run_replay_request, "run.replay")
    return _apply(modeladmin, request, queryset.select_related("job_version"), act, "Replayed")


class BackfillForm(forms.Form):
    """The range of `backfill_jobs`, validated by the API's BackfillSerializer."""

    start = forms.CharField(help_text="Inclusive; ISO 8601 with an offset: 2025-01-01T00:00:00Z.")
    end = forms.CharField(help_text="Exclusive, not in the future; e.g. 2025-01-02T00:00:00Z.")

    def __init__(self, *args, now: dt.datetime, **kwargs):
        super().__init__(*args, **kwargs)
        self.now = now

    def clean(self):
        window = BackfillSerializer(data=self.cleaned_data, context={"now": self.now})
        if not window.is_valid():
            for field, problems in window.errors.items():
                for problem in problems:
                    self.add_error(field if field in self.fields else None, problem)
            return self.cleaned_data
        return window.validated_data


@admin.action(description="Backfill the selected jobs over a range…", permissions=["trigger"])
def backfill_jobs(modeladmin, request, queryset):
    """First the intermediate page asking for the range; then, on `apply`, one backfill per
    job through `job_backfill`, each job's occurrences by its own schedule."""
    selected = _selection(modeladmin, request, queryset)
    if selected is None:
        return _back(request)
    now = db_now()
    form = BackfillForm(request.POST if "apply" in request.POST else None, now=now)
    if not form.is_valid():
        context = {
            **modeladmin.admin_site.each_context(request),
            "title": "Backfill jobs",
            "opts": modeladmin.opts,
            "form": form,
            "jobs": selected,
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            "next": request.POST.get("next", ""),
        }
        return TemplateResponse(
            request, "admin/jobs/job/backfill.html", context, status=400 if form.is_bound else 200
        )
    refused, created, existing, pruned = defaultdict(list), 0, 0, 0
    for job in selected:
        try:
            instants = backfill_instants(job=job, **form.cleaned_data)
        except serializers.ValidationError as exc:
            reason = " ".join(validation_messages(exc.detail))
            refused[reason].append(_label(job))
            continue
        result = job_backfill(job=job, instants=instants, actor=request.user, now=now)
        if result is None:
            job.refresh_from_db(fields=["state"])
            refused[refusal("job.backfill", state=job.state)].append(_label(job))
            continue
        created += len(result.created)
        existing += len(result.existing)
        pruned += len(result.pruned)
    gone = f", {pruned} ran before and were pruned" if pruned else ""
    _report(modeladmin, request, verb="Backfilled", selected=selected, refused=refused,
            extra=f" ({created} runs created, {existing} already existed{gone})")  # fmt: skip
    return _back(request)


JOB_ACTIONS = [pause_jobs, resume_jobs, cancel_jobs, trigger_jobs, backfill_jobs]
RUN_ACTIONS = [cancel_runs, replay_runs]
# The same actions as buttons on one job's or run's page: (label, the action's name in
# jobs.transitions' tables of the states it may start from).
BUTTONS = {
    "pause_jobs": ("Pause", "job.pause"),
    "resume_jobs": ("Resume", "job.resume"),
    "cancel_jobs": ("Cancel", "job.cancel"),
    "trigger_jobs": ("Trigger now", "job.trigger"),
    "backfill_jobs": ("Backfill…", "job.backfill"),
    "cancel_runs": ("Cancel", "run.cancel"),
    "replay_runs": ("Replay", "run.replay"),
}


def action_buttons(modeladmin, request, obj) -> list[dict]:
    """The actions this user may take on `obj` in its state, as buttons for its page (each
    posts the list's action for that one object, and comes back): a cancelled job offers
    none, a paused one Resume and not Pause."""
    buttons = []
    for name in modeladmin.get_actions(request):
        label, action = BUTTONS.get(name, (name, None))
        if action is None or action_possible(action=action, obj=obj):
            buttons.append({"name": name, "label": label})
    return buttons
