"""POST /jobs/bulk/: up to BULK_MAX_JOBS jobs in one request, all created or none, each
item with its own optional idempotency key."""

from __future__ import annotations

import datetime as dt

from django.db import transaction
from drf_spectacular.utils import OpenApiExample, extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from ..calendar_services import job_calendar_refusals
from ..clock import request_now
from ..idempotency import (
    MAX_KEY_LENGTH,
    idempotency_claim,
    idempotency_key_problem,
    idempotency_store,
    request_hash,
)
from ..models import MANAGED_LABEL
from ..selectors import job_list
from ..services import job_create_bulk
from .base import ManagedNameTaken, unique_name_guard
from .jobs import CREATE_SCOPE, JobOutput
from .validation import JobSpecSerializer, dependencies_check, job_spec_check

BULK_MAX_JOBS = 1000


class BulkItemSerializer(JobSpecSerializer):
    """A job body with an optional `idempotency_key` (for the schema; see JobBulkApi)."""

    idempotency_key = serializers.CharField(
        required=False,
        max_length=MAX_KEY_LENGTH,
        help_text="As the Idempotency-Key header of POST /jobs/, for this item.",
    )


class BulkOutput(serializers.Serializer):
    jobs = JobOutput(many=True, help_text="Aligned with the request's items.")
    replayed = serializers.ListField(
        child=serializers.BooleanField(),
        help_text="Per item: true when its idempotency_key answered with the job it created "
        "earlier.",
    )


class BulkErrors(serializers.Serializer):
    detail = serializers.CharField()
    errors = serializers.ListField(
        required=False,
        child=serializers.DictField(allow_null=True),
        help_text="Aligned with the request's items: null for a valid item, else its "
        "errors by field, as POST /jobs/ would answer them. Absent when the body as a whole "
        "is refused (not an array, too many items).",
    )


def _bulk_items(data, *, now: dt.datetime, visible) -> tuple[list, list, list, list]:
    """(specs, first fires, keys, errors), each aligned with the items; validation without
    the database, but for the upstreams an `after` schedule names (`visible`: the jobs the
    caller may see)."""
    specs, firsts, keys, errors, seen = [], [], [], [], {}
    for index, item in enumerate(data):
        spec = key = error = first = None
        if not isinstance(item, dict):
            error = {"non_field_errors": ["Must be a JSON object (a job body)."]}
        else:
            body = dict(item)
            key = body.pop("idempotency_key", None)
            if key is not None:
                text = isinstance(key, str)
                problem = idempotency_key_problem(key) if text else "Must be a string."
                if problem is None and key in seen:
                    problem = f"Item {seen[key]} of this request has the same key."
                if problem:
                    error, key = {"idempotency_key": [problem]}, None
                else:
                    seen[key] = index
            try:
                spec, first = job_spec_check(body, now=now)
                dependencies_check(spec=spec, visible=visible)
            except serializers.ValidationError as exc:
                error = {**exc.detail, **(error or {})}
            if error:
                spec = None
        specs.append(spec)
        firsts.append(first)
        keys.append(key)
        errors.append(error)
    return specs, firsts, keys, errors


class JobBulkApi(APIView):
    throttle_scope = "bulk"  # jobs.throttling: tighter than the per-user rate

    @extend_schema(
        request=BulkItemSerializer(many=True),
        responses={201: BulkOutput, 400: BulkErrors, 409: BulkErrors},
        examples=[
            OpenApiExample(
                "Two jobs, one with a key",
                request_only=True,
                value=[
                    {
                        "name": "report 1",
                        "task": "scheduler.echo",
                        "schedule": {"kind": "cron", "expression": "0 9 * * *"},
                        "idempotency_key": "report-1",
                    },
                    {
                        "name": "once",
                        "task": "scheduler.echo",
                        "schedule": {"kind": "once", "run_at": "2030-01-01T00:00:00Z"},
                    },
                ],
            )
        ],
    )
    def post(self, request):
        if not isinstance(request.data, list):
            return _bulk_problem("Must be a JSON array of job bodies.")
        if len(request.data) > BULK_MAX_JOBS:
            return _bulk_problem(
                f"At most {BULK_MAX_JOBS} jobs per request, not {len(request.data)}."
            )
        now = request_now(request)
        specs, firsts, keys, errors = _bulk_items(
            request.data, now=now, visible=lambda: job_list(user=request.user)
        )
        refusals = job_calendar_refusals(owned=[(request.user.pk, spec) for spec in specs])
        for index, refusal in enumerate(refusals):
            if refusal:  # as POST /jobs/ answers it, per item
                errors[index], specs[index] = {"calendars": [refusal]}, None
        digests = {
            key: request_hash({k: v for k, v in item.items() if k != "idempotency_key"})
            for key, item in zip(keys, request.data, strict=True)
            if key is not None
        }
        with transaction.atomic():
            earlier = idempotency_claim(
                owner=request.user, scope=CREATE_SCOPE, digests=digests, now=now
            )
            for index, key in enumerate(keys):
                if key in earlier:
                    if earlier[key].request_hash == digests[key]:
                        errors[index] = None  # replayed: its body is the one already accepted
                    else:
                        errors[index] = {"idempotency_key": [
                            f"'{key}' was already used with another request body."]}  # fmt: skip
            if any(errors):
                transaction.set_rollback(True)
                return _bulk_refusal(errors, keys, earlier)
            fresh = [index for index, key in enumerate(keys) if key not in earlier]
            try:
                jobs = unique_name_guard(
                    lambda: job_create_bulk(
                        owner=request.user,
                        specs=[specs[index] for index in fresh],
                        first_fires=[firsts[index] for index in fresh],
                        now=now,
                    ),
                    specs=[specs[index] for index in fresh],
                )
            except ManagedNameTaken:
                transaction.set_rollback(True)
                return Response(
                    {"detail": f"A job labelled {MANAGED_LABEL} names one its owner already "
                     "has live (or twice in this request): none was created."},
                    status=status.HTTP_409_CONFLICT,
                )  # fmt: skip
            bodies = JobOutput(jobs, many=True).data
            answers = [earlier[key].response_body if key in earlier else None for key in keys]
            for index, body in zip(fresh, bodies, strict=True):
                answers[index] = body
            idempotency_store(
                owner=request.user,
                scope=CREATE_SCOPE,
                status=status.HTTP_201_CREATED,
                bodies={keys[index]: answers[index] for index in fresh if keys[index]},
            )
        return Response(
            {"jobs": answers, "replayed": [key in earlier for key in keys]},
            status=status.HTTP_201_CREATED,
        )


def _bulk_problem(detail: str) -> Response:
    return Response({"detail": detail}, status=status.HTTP_400_BAD_REQUEST)


def _bulk_refusal(errors: list, keys: list, earlier: dict) -> Response:
    """400 naming each bad item; 409 when the only problems are keys used with other bodies."""
    bad = [index for index, error in enumerate(errors) if error]
    conflicts = all(keys[index] in earlier and set(errors[index]) == {"idempotency_key"}
                    for index in bad)  # fmt: skip
    return Response(
        {
            "detail": f"{len(bad)} of {len(errors)} jobs refused; none was created.",
            "errors": errors,
        },
        status=status.HTTP_409_CONFLICT if conflicts else status.HTTP_400_BAD_REQUEST,
    )
