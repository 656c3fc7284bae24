"""What every API view shares: the error handler, pagination, the headers' parameters, and
the steps each view repeats (read its filters, page a list, answer once per
Idempotency-Key, find a visible job, refuse with a 409)."""

from __future__ import annotations

import datetime as dt

from django.http import Http404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter
from rest_framework import serializers, status
from rest_framework.pagination import CursorPagination
from rest_framework.response import Response
from rest_framework.views import exception_handler

from ..clock import db_now
from ..idempotency import IdempotencyConflict, idempotency_key_problem, idempotent_answer
from ..selectors import job_get
from ..services import JobQuotaExceeded


def api_exception_handler(exc, context):
    """DRF's, plus the domain's refusals that are not bad input: an owner over its job
    quota answers 429 (docs/security.md); the transaction of the request rolled back."""
    if isinstance(exc, JobQuotaExceeded):
        return Response({"detail": str(exc)}, status=status.HTTP_429_TOO_MANY_REQUESTS)
    return exception_handler(exc, context)


class NewestFirst(CursorPagination):
    """Cursor pagination; the list's `ordering` query parameter picks the order."""

    page_size = 50
    max_page_size = 500
    page_size_query_param = "page_size"
    ordering = ("-created_at", "-id")

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
