"""The queues' API, operators only: the list with live figures (the broker's ready count
beside PostgreSQL's), pause, resume and the fleet-wide cap and rate (jobs.queues).

It lives in dispatch because `ready` asks the broker (dispatch.reconciler.BrokerQueueDepth)."""

from __future__ import annotations

import datetime as dt

from django.conf import settings
from django.http import Http404
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from jobs.api.validation import AwareDateTimeField, StrictIntegerField, StrictSerializer
from jobs.clock import db_now
from jobs.queues import (
    RateLimitInvalid,
    queue_configured,
    queue_list,
    queue_pause,
    queue_resume,
    queue_update,
    rate_limit_parse,
)
from jobs.roles import IsOperator

from .reconciler import BrokerQueueDepth


class QueueOutput(serializers.Serializer):
    name = serializers.CharField()
    lane_of = serializers.CharField(allow_null=True, help_text="The queue a lane belongs to.")
    paused = serializers.BooleanField()
    paused_reason = serializers.CharField()
    paused_until = serializers.DateTimeField(allow_null=True)
    ready = serializers.IntegerField(allow_null=True, help_text="Messages in the broker.")
    waiting = serializers.IntegerField(help_text="Runs held in PostgreSQL (the outbox).")
    running = serializers.IntegerField()
    max_running = serializers.IntegerField(allow_null=True)
    rate_limit = serializers.CharField(allow_null=True)


class QueueListOutput(serializers.Serializer):
    results = QueueOutput(many=True, help_text="Each configured queue followed by its lanes.")


def _queues(name: str | None = None) -> list:
    depth = BrokerQueueDepth(settings.CELERY_BROKER_URL, settings.CELERY_BROKER_TRANSPORT_OPTIONS)
    try:
        views = queue_list(now=db_now(), depth=depth)
    finally:
        depth.close()
    return [view for view in views if name is None or name in (view.name, view.lane_of)]


def _configured(name: str) -> str:
    if not queue_configured(name):
        raise Http404
    return name


class QueueListApi(APIView):
    permission_classes = [IsOperator]

    @extend_schema(operation_id="api_v1_queues_list", responses=QueueListOutput)
    def get(self, request):
        return Response({"results": QueueOutput(_queues(), many=True).data})


class QueuePatchInput(StrictSerializer):
    max_running = StrictIntegerField(min_value=1, allow_null=True, required=False)
    rate_limit = serializers.CharField(allow_null=True, required=False, max_length=40)

    def validate_rate_limit(self, value):
        if value is not None:
            try:
                rate_limit_parse(value)
            except RateLimitInvalid as exc:
                raise serializers.ValidationError(str(exc)) from exc
        return value


class QueueDetailApi(APIView):
    permission_classes = [IsOperator]

    @extend_schema(responses=QueueListOutput)
    def get(self, request, name):
        return Response({"results": QueueOutput(_queues(_configured(name)), many=True).data})

    @extend_schema(request=QueuePatchInput, responses=QueueListOutput)
    def patch(self, request, name):
        _configured(name)
        data = QueuePatchInput(data=request.data)
        data.is_valid(raise_exception=True)
        queue_update(name=name, actor=request.user, **data.validated_data)
        return Response({"results": QueueOutput(_queues(name), many=True).data})


class QueuePauseInput(StrictSerializer):
    reason = serializers.CharField(max_length=500, required=False, default="", allow_blank=True)
    until = AwareDateTimeField(required=False, allow_null=True, default=None)


class QueuePauseApi(APIView):
    permission_classes = [IsOperator]

    @extend_schema(request=QueuePauseInput, responses=QueueListOutput)
    def post(self, request, name):
        _configured(name)
        data = QueuePauseInput(data=request.data)
        data.is_valid(raise_exception=True)
        now = db_now()
        until = data.validated_data["until"]
        until = dt.datetime.fromisoformat(until) if until else None
        if until is not None and until <= now:
            raise serializers.ValidationError({"until": ["Must be in the future."]})
        queue_pause(name=name, actor=request.user, reason=data.validated_data["reason"],
                    until=until, now=now)  # fmt: skip
        return Response({"results": QueueOutput(_queues(name), many=True).data})


class QueueResumeApi(APIView):
    permission_classes = [IsOperator]

    @extend_schema(request=None, responses=QueueListOutput)
    def post(self, request, name):
        queue_resume(name=_configured(name), actor=request.user)
        return Response({"results": QueueOutput(_queues(name), many=True).data})
