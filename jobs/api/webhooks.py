"""Webhooks: an owner's subscriptions (list, create, read, change, delete), a `ping` on
demand, and each one's deliveries with their attempts (docs/webhooks.md)."""

from __future__ import annotations

from django.conf import settings
from django.http import Http404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema, extend_schema_field
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from ..clock import db_now
from ..models import Job, WebhookDeliveryState, WebhookEvent
from ..webhooks import (
    WebhookAddressRefused,
    webhook_addresses,
    webhook_create,
    webhook_delete,
    webhook_delivery_list,
    webhook_get,
    webhook_list,
    webhook_ping,
    webhook_update,
)
from .base import NewestFirst, paginated

MAX_JOBS = 1000


class WebhookInput(serializers.Serializer):
    url = serializers.URLField(max_length=2000)
    events = serializers.ListField(
        child=serializers.ChoiceField(choices=WebhookEvent.values),
        allow_empty=False,
        help_text="run.succeeded is sent only to webhooks that name it.",
    )
    jobs = serializers.ListField(
        child=serializers.UUIDField(),
        allow_null=True,
        required=False,
        max_length=MAX_JOBS,
        help_text="Only these jobs of the owner; absent or null: all of the owner's jobs.",
    )

    def validate_url(self, url: str) -> str:
        try:
            webhook_addresses(url=url, allow_private=settings.SCHEDULER_WEBHOOK_ALLOW_PRIVATE)
        except WebhookAddressRefused as exc:
            raise serializers.ValidationError(str(exc)) from None
        return url

    def validate_jobs(self, jobs):
        if jobs is None:
            return None
        owner = self.context["owner"]
        known = set(
            Job.objects.filter(owner=owner, deleted_at=None, id__in=jobs).values_list(
                "id", flat=True
            )
        )
        unknown = [str(job_id) for job_id in jobs if job_id not in known]
        if unknown:
            raise serializers.ValidationError(f"No such job of the owner: {', '.join(unknown)}.")
        return jobs


class WebhookOutput(serializers.Serializer):
    id = serializers.UUIDField()
    owner = serializers.CharField()
    url = serializers.URLField()
    events = serializers.ListField(child=serializers.CharField())
    jobs = serializers.ListField(child=serializers.UUIDField(), allow_null=True)
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()


class WebhookCreatedOutput(WebhookOutput):
    secret = serializers.CharField(
        help_text="The key of the signatures (X-Scheduler-Signature); shown only here, once."
    )


class WebhookAttemptOutput(serializers.Serializer):
    number = serializers.IntegerField()
    started_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField(allow_null=True)
    status_code = serializers.IntegerField(allow_null=True)
    error = serializers.CharField()


class WebhookDeliveryOutput(serializers.Serializer):
    id = serializers.UUIDField(help_text="X-Scheduler-Delivery: the same at every try.")
    event = serializers.CharField()
    state = serializers.ChoiceField(choices=WebhookDeliveryState.values)
    job = serializers.UUIDField(source="job_id", allow_null=True)
    run = serializers.UUIDField(source="run_id", allow_null=True)
    created_at = serializers.DateTimeField()
    attempt_count = serializers.IntegerField()
    last_status_code = serializers.IntegerField(allow_null=True)
    next_retry_at = serializers.SerializerMethodField()
    delivered_at = serializers.DateTimeField(allow_null=True)
    attempts = WebhookAttemptOutput(many=True)

    @extend_schema_field(OpenApiTypes.DATETIME)
    def get_next_retry_at(self, delivery):
        """When it is posted next (or the lease of a try in flight ends); null once done."""
        if delivery.state != WebhookDeliveryState.PENDING:
            return None
        return serializers.DateTimeField().to_representation(delivery.next_attempt_at)


def _visible(request, webhook_id):
    webhook = webhook_get(user=request.user, webhook_id=webhook_id)
    if webhook is None:
        raise Http404
    return webhook


class WebhookListApi(APIView):
    pagination_class = NewestFirst

    @extend_schema(responses=WebhookOutput(many=True))
    def get(self, request):
        return paginated(request, self, webhook_list(user=request.user), WebhookOutput, {})

    @extend_schema(request=WebhookInput, responses={201: WebhookCreatedOutput})
    def post(self, request):
        given = WebhookInput(data=request.data, context={"owner": request.user})
        given.is_valid(raise_exception=True)
        webhook = webhook_create(owner=request.user, url=given.validated_data["url"],
                                 events=given.validated_data["events"],
                                 jobs=given.validated_data.get("jobs"))  # fmt: skip
        return Response(WebhookCreatedOutput(webhook).data, status=status.HTTP_201_CREATED)


class WebhookDetailApi(APIView):
    @extend_schema(responses=WebhookOutput)
    def get(self, request, webhook_id):
        return Response(WebhookOutput(_visible(request, webhook_id)).data)

    @extend_schema(request=WebhookInput(partial=True), responses=WebhookOutput)
    def patch(self, request, webhook_id):
        webhook = _visible(request, webhook_id)
        given = WebhookInput(data=request.data, partial=True, context={"owner": webhook.owner})
        given.is_valid(raise_exception=True)
        webhook = webhook_update(webhook=webhook, fields=given.validated_data)
        return Response(WebhookOutput(webhook).data)

    @extend_schema(responses={204: None})
    def delete(self, request, webhook_id):
        webhook_delete(webhook=_visible(request, webhook_id))
        return Response(status=status.HTTP_204_NO_CONTENT)


class WebhookTestApi(APIView):
    @extend_schema(request=None, responses={202: WebhookDeliveryOutput})
    def post(self, request, webhook_id):
        delivery = webhook_ping(webhook=_visible(request, webhook_id), now=db_now())
        return Response(WebhookDeliveryOutput(delivery).data, status=status.HTTP_202_ACCEPTED)


class WebhookDeliveryListApi(APIView):
    pagination_class = NewestFirst

    @extend_schema(responses=WebhookDeliveryOutput(many=True))
    def get(self, request, webhook_id):
        deliveries = webhook_delivery_list(webhook=_visible(request, webhook_id))
        return paginated(request, self, deliveries, WebhookDeliveryOutput, {})
