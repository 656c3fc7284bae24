"""What every API view shares: the error handler, pagination, the headers' parameters, and
the steps each view repeats (read its filters, page a list, answer once per
Idempotency-Key, find a visible job, refuse with a 409)."""

from __future__ import annotations

import datetime as dt

from django.db import IntegrityError, transaction
from django.http import Http404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter
from rest_framework import serializers, status
from rest_framework.authentication import get_authorization_header
from rest_framework.exceptions import NotAuthenticated, NotFound
from rest_framework.pagination import CursorPagination
from rest_framework.response import Response
from rest_framework.views import exception_handler

from ..calendars import CalendarRefused
from ..clock import db_now
from ..idempotency import IdempotencyConflict, idempotency_key_problem, idempotent_answer
from ..models import MANAGED_LABEL, MANAGED_NAME_CONSTRAINT, Job
from ..selectors import job_get
from ..services import JobQuotaExceeded


def api_exception_handler(exc, context):
    """DRF's, plus the domain's refusals that are not bad input: an owner over its job
    quota answers 429 (docs/security.md); the transaction of the request rolled back."""
    if isinstance(exc, JobQuotaExceeded):
        return Response({"detail": str(exc)}, status=status.HTTP_429_TOO_MANY_REQUESTS)
    if isinstance(exc, CalendarRefused):  # the same words whether it exists or not
        return Response({"calendars": [str(exc)]}, status=status.HTTP_400_BAD_REQUEST)
    if isinstance(exc, NotAuthenticated):
        exc = _with_scheme_hint(exc, context["request"])
    return exception_handler(exc, context)


def _with_scheme_hint(exc: NotAuthenticated, request) -> NotAuthenticated:
    """A "credentials were not provided" to a request that sent some, in a scheme this API
    does not read (`Bearer`, `Basic`): say which one it reads. (Only /metrics reads
    `Bearer`, through its own permission: docs/security.md.)"""
    scheme = get_authorization_header(request).split(b" ", 1)[0]
    if not scheme or not request.path.startswith("/api/"):  # /metrics reads Bearer
        return exc
    shown = scheme.decode("latin-1")[:20]
    return NotAuthenticated(
        f"Unknown authorization scheme {shown!r}: send `Authorization: Token <key>` "
        "(docs/api.md, Access)."
    )


class NewestFirst(CursorPagination):
    """Cursor pagination; the list's `ordering` query parameter picks the order."""

    page_size = 50
    max_page_size = 500
    page_size_query_param = "page_size"
    ordering = ("-created_at", "-id")

    def decode_cursor(self, request):
        # DRF answers an unreadable cursor 404 ("Invalid cursor"); it is bad input, named.
        try:
            return super().decode_cursor(request)
        except NotFound:
            raise serializers.ValidationError(
                {"cursor": ["Not a cursor this list gave out: use the `next` or `previous` link."]}
            ) from None

    def paginate_queryset(self, queryset, request, view=None):
        order = getattr(view, "order", None)
        if order:
            tie = "-id" if order.startswith("-") else "id"
            self.ordering = (order, tie)
        return super().paginate_queryset(queryset, request, view)


IDEMPOTENCY_KEY = OpenApiParameter(
    "Idempotency-Key",
    OpenApiTypes.STR,
    OpenApiParameter.HEADER,
    description="Repeat a request safely: the same key with the same body answers with the "
    "first result (kept 24 h); with another body, 409.",
)
IF_MATCH = OpenApiParameter(
    "If-Match",
    OpenApiTypes.STR,
    OpenApiParameter.HEADER,
    description="The job version the change is based on; 412 when the job has moved on.",
)


class Problem(serializers.Serializer):
    detail = serializers.CharField()
    state = serializers.CharField(required=False)


# The query parameters of every paginated list besides its filters.
PAGING_PARAMETERS = frozenset({"cursor", "page_size"})


def read_filters(serializer_class, request) -> dict:
    """The list's filters; an unknown query parameter (a typo such as `status` for
    `state`) answers 400 naming it, instead of silently listing everything."""
    filters = serializer_class(data=request.query_params)
    unknown = sorted(set(request.query_params) - set(filters.fields) - PAGING_PARAMETERS)
    if unknown:
        raise serializers.ValidationError({name: ["Unknown query parameter."] for name in unknown})
    filters.is_valid(raise_exception=True)
    return filters.validated_data


def paginated(request, view, queryset, output, filters: dict):
    view.order = filters.get("ordering")
    paginator = view.pagination_class()
    page = paginator.paginate_queryset(queryset, request, view=view)
    data = output(page, many=True, context={"viewer": request.user}).data
    return paginator.get_paginated_response(data)


def _idempotency_key(request) -> str | None:
    key = request.headers.get("Idempotency-Key")
    if key is None:
        return None
    problem = idempotency_key_problem(key)
    if problem:
        raise serializers.ValidationError({"Idempotency-Key": [problem]})
    return key


def idempotent_response(
    request, *, scope: str, produce, now: dt.datetime | None = None, lockless: bool = False
) -> Response:
    """Run `produce` once per Idempotency-Key (if the request has one); `lockless` as
    jobs.idempotency.idempotent_answer's."""
    key = _idempotency_key(request)
    try:
        answer = idempotent_answer(
            owner=request.user,
            scope=scope,
            key=key,
            body=request.data,
            now=now if now is not None or key is None else db_now(),
            produce=produce,
            lockless=lockless,
        )
    except IdempotencyConflict as exc:
        return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
    response = Response(answer.body, status=answer.status)
    if answer.replayed:
        response["Idempotent-Replayed"] = "true"
    return response


def visible_job(request, job_id):
    job = job_get(user=request.user, job_id=job_id)
    if job is None:
        raise Http404
    return job


def conflict(detail: str, *, state: str) -> Response:
    return Response({"detail": detail, "state": state}, status=status.HTTP_409_CONFLICT)


def managed_name_taken(exc: IntegrityError) -> bool:
    """The violation is of the unique name of managed jobs (jobs.models.Job)."""
    diag = getattr(exc.__cause__, "diag", None)
    return getattr(diag, "constraint_name", None) == MANAGED_NAME_CONSTRAINT


def managed_name_conflict(*, owner, name: str) -> Response:
    """409 naming the live managed job that holds `name` (the caller's own)."""
    holder = (
        Job.objects.filter(owner=owner, name=name, deleted_at=None, state__in=["active", "paused"])
        .filter(labels__has_key=MANAGED_LABEL)
        .values_list("id", flat=True)
        .first()
    )
    return Response(
        {
            "detail": f"A live job labelled {MANAGED_LABEL} is already named {name!r}: names of "
            "managed jobs are unique per owner.",
            "name": name,
            "job": str(holder) if holder else None,
        },
        status=status.HTTP_409_CONFLICT,
    )


def unique_name_guard(write, *, specs: list[dict] | None = None):
    """Run `write()` in a savepoint; a managed job's name already taken raises
    ManagedNameTaken (the caller answers 409), any other integrity error propagates.

    `specs`, when given, are all the specs `write` stores: if none is labelled MANAGED_LABEL
    no managed name can be taken, and `write()` runs as it is, in no block of this guard's
    (two round trips fewer inside a caller's transaction, which an integrity error then
    rolls back whole; a refusal raised before `write` writes, such as an owner's quota,
    leaves that transaction usable)."""
    if specs is not None and not any(MANAGED_LABEL in spec["labels"] for spec in specs):
        return write()
    try:
        with transaction.atomic():
            return write()
    except IntegrityError as exc:
        if managed_name_taken(exc):
            raise ManagedNameTaken from exc
        raise


class ManagedNameTaken(Exception):
    pass
