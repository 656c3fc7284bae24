"""Bulk operations (`POST /runs/bulk/cancel|replay/`, `POST /jobs/bulk/pause|resume|cancel/`)
and their progress (`GET /operations/{id}/`): the list endpoints' filters, a dry run that
only counts, an Idempotency-Key; the work itself is jobs.operations'."""

from __future__ import annotations

from django.http import Http404
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from ..clock import db_now
from ..idempotency import Answer
from ..models import BulkOperation
from ..operations import operation_count, operation_create, operation_matching
from ..roles import user_is_operator
from .base import PAGING_PARAMETERS, idempotent_response
from .jobs import JobFilters
from .runs import RunFilters
from .validation import StrictSerializer


class BulkInput(StrictSerializer):
    filter = serializers.DictField(
        required=False, default=dict, help_text="The list endpoint's filters (its query "
        "parameters as a JSON object); {} matches everything the caller may see.",
    )  # fmt: skip
    dry_run = serializers.BooleanField(required=False, default=False)


class DryRunOutput(serializers.Serializer):
    matched = serializers.IntegerField()


class OperationOutput(serializers.Serializer):
    id = serializers.UUIDField()
    action = serializers.CharField()
    filter = serializers.JSONField()
    state = serializers.CharField(help_text="running, done")
    matched = serializers.IntegerField()
    done = serializers.IntegerField()
    refused = serializers.DictField(child=serializers.IntegerField(), help_text="Per reason.")
    created_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField(allow_null=True)


def _filters(filter_class, given: dict) -> dict:
    """The filter validated as the list's query parameters are (unknown keys named)."""
    serializer = filter_class(data=given)
    unknown = sorted(set(given) - set(serializer.fields) - PAGING_PARAMETERS - {"ordering"})
    if unknown:
        raise serializers.ValidationError({"filter": {k: ["Unknown filter."] for k in unknown}})
    if not serializer.is_valid():
        raise serializers.ValidationError({"filter": serializer.errors})
    return serializer.validated_data


class _BulkApi(APIView):
    action: str
    filter_class: type

    @extend_schema(request=BulkInput, responses={200: DryRunOutput, 202: OperationOutput})
    def post(self, request):
        body = BulkInput(data=request.data)
        body.is_valid(raise_exception=True)
        given = body.validated_data["filter"]
        filters = _filters(self.filter_class, given)
        if body.validated_data["dry_run"]:
            matched = operation_count(user=request.user, action=self.action, filters=filters)
            return Response({"matched": matched})
        now = db_now()

        def create() -> Answer:
            targets = operation_matching(user=request.user, action=self.action, filters=filters)
            operation = operation_create(user=request.user, action=self.action, targets=targets,
                                         stored_filter=given, now=now)  # fmt: skip
            return Answer(status.HTTP_202_ACCEPTED, OperationOutput(operation).data)

        return idempotent_response(request, scope=f"bulk.{self.action}", produce=create, now=now)


class RunBulkCancelApi(_BulkApi):
    action, filter_class = "runs.cancel", RunFilters


class RunBulkReplayApi(_BulkApi):
    action, filter_class = "runs.replay", RunFilters


class JobBulkPauseApi(_BulkApi):
    action, filter_class = "jobs.pause", JobFilters


class JobBulkResumeApi(_BulkApi):
    action, filter_class = "jobs.resume", JobFilters


class JobBulkCancelApi(_BulkApi):
    action, filter_class = "jobs.cancel", JobFilters


class OperationDetailApi(APIView):
    @extend_schema(responses=OperationOutput)
    def get(self, request, operation_id):
        operations = BulkOperation.objects.filter(id=operation_id)
        if not user_is_operator(request.user):
            operations = operations.filter(owner=request.user)
        operation = operations.first()
        if operation is None:
            raise Http404
        return Response(OperationOutput(operation).data)
