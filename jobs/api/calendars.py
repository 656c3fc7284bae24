"""Calendars: the list and creation, a calendar's detail, change and deletion, and the
import of an iCalendar file into one."""

from __future__ import annotations

import datetime as dt

from django.http import Http404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, OpenApiParameter, extend_schema
from rest_framework import parsers, serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from ..calendar_services import (
    calendar_create,
    calendar_delete,
    calendar_get,
    calendar_jobs,
    calendar_list,
    calendar_update,
)
from ..calendars import CalendarError, calendar_import_entries, calendar_spec_check
from ..clock import db_now
from ..occurrences import OCCURRENCES_PAGE_MAX, cursor_decode, cursor_encode, job_occurrences
from .base import NewestFirst, Problem, paginated, visible_job
from .validation import AwareDateTimeField, StrictSerializer

SPEC_FIELDS = ("timezone", "dates", "ranges", "rrules", "holidays")


class CalendarInput(StrictSerializer):
    name = serializers.CharField(max_length=200)
    timezone = serializers.CharField(max_length=64, default="UTC")
    dates = serializers.ListField(child=serializers.CharField(), default=list)
    ranges = serializers.ListField(child=serializers.DictField(), default=list)
    rrules = serializers.ListField(child=serializers.CharField(), default=list)
    holidays = serializers.DictField(required=False, allow_null=True, default=None)

    def validate(self, attrs):
        try:
            spec = calendar_spec_check({field: attrs.get(field) for field in SPEC_FIELDS})
        except CalendarError as exc:
            raise serializers.ValidationError({exc.field: [str(exc)]}) from exc
        return {"name": attrs["name"], "spec": spec}


class CalendarOutput(serializers.Serializer):
    id = serializers.UUIDField()
    owner = serializers.CharField(source="owner.get_username")
    name = serializers.CharField()
    version = serializers.IntegerField()
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()

    def to_representation(self, calendar):
        return {**super().to_representation(calendar), **calendar.spec}


class CalendarDetailOutput(CalendarOutput):
    jobs = serializers.SerializerMethodField(help_text="The live jobs that name it.")

    def get_jobs(self, calendar) -> list[dict]:
        return [
            {"id": str(job.id), "name": job.name, "state": job.state}
            for job in calendar_jobs(calendar=calendar)[:200]
        ]


def visible_calendar(request, calendar_id):
    calendar = calendar_get(user=request.user, calendar_id=calendar_id)
    if calendar is None:
        raise Http404
    return calendar


CALENDAR_EXAMPLE = {
    "name": "Bavarian holidays and the year-end freeze",
    "timezone": "Europe/Berlin",
    "dates": ["2026-12-31"],
    "ranges": [{"start": "2026-12-24T18:00", "end": "2026-12-27T06:00", "name": "freeze"}],
    "rrules": ["FREQ=YEARLY;BYMONTH=5;BYMONTHDAY=1"],
    "holidays": {"country": "DE", "subdivision": "BY"},
}


class CalendarListApi(APIView):
    pagination_class = NewestFirst

    @extend_schema(responses=CalendarOutput(many=True))
    def get(self, request):
        return paginated(request, self, calendar_list(user=request.user), CalendarOutput, {})

    @extend_schema(
        request=CalendarInput,
        responses={201: CalendarDetailOutput},
        examples=[
            OpenApiExample("Holidays and a freeze", request_only=True, value=CALENDAR_EXAMPLE)
        ],
    )
    def post(self, request):
        data = CalendarInput(data=request.data)
        data.is_valid(raise_exception=True)
        calendar = calendar_create(owner=request.user, now=db_now(), **data.validated_data)
        return Response(CalendarDetailOutput(calendar).data, status=status.HTTP_201_CREATED)


class CalendarDetailApi(APIView):
    @extend_schema(responses=CalendarDetailOutput)
    def get(self, request, calendar_id):
        return Response(CalendarDetailOutput(visible_calendar(request, calendar_id)).data)

    @extend_schema(
        request=CalendarInput(partial=True), responses={200: CalendarDetailOutput, 412: Problem}
    )
    def patch(self, request, calendar_id):
        calendar = visible_calendar(request, calendar_id)
        if not isinstance(request.data, dict):
            raise serializers.ValidationError({"non_field_errors": ["Must be a JSON object."]})
        data = CalendarInput(data={"name": calendar.name, **calendar.spec, **request.data})
        data.is_valid(raise_exception=True)
        changed = calendar_update(
            calendar=calendar,
            expected_version=calendar.version,
            actor=request.user,
            now=db_now(),
            **data.validated_data,
        )
        if not changed:
            return Response({"detail": "the calendar changed meanwhile; read it again"},
                            status=status.HTTP_412_PRECONDITION_FAILED)  # fmt: skip
        return Response(CalendarDetailOutput(visible_calendar(request, calendar_id)).data)

    @extend_schema(request=None, responses={204: None, 409: Problem})
    def delete(self, request, calendar_id):
        calendar = visible_calendar(request, calendar_id)
        if not calendar_delete(calendar=calendar, actor=request.user, now=db_now()):
            return Response({"detail": "live jobs name this calendar; change them first"},
                            status=status.HTTP_409_CONFLICT)  # fmt: skip
        return Response(status=status.HTTP_204_NO_CONTENT)


class ICalendarParser(parsers.BaseParser):
    media_type = "text/calendar"

    def parse(self, stream, media_type=None, parser_context=None):
        return stream.read(1_000_001)


class CalendarImportApi(APIView):
    parser_classes = [ICalendarParser]

    @extend_schema(request={"text/calendar": bytes}, responses={200: CalendarDetailOutput})
    def post(self, request, calendar_id):
        calendar = visible_calendar(request, calendar_id)
        body = request.data if isinstance(request.data, bytes) else b""
        if len(body) > 1_000_000:
            raise serializers.ValidationError({"body": ["At most 1,000,000 bytes."]})
        now = db_now()
        try:
            spec = calendar_import_entries(body=body, spec=calendar.spec, now=now)
        except CalendarError as exc:
            raise serializers.ValidationError({exc.field: [str(exc)]}) from exc
        if not calendar_update(calendar=calendar, name=calendar.name, spec=spec,
                               expected_version=calendar.version, actor=request.user,
                               now=now):  # fmt: skip
            return Response({"detail": "the calendar changed meanwhile; import again"},
                            status=status.HTTP_412_PRECONDITION_FAILED)  # fmt: skip
        return Response(CalendarDetailOutput(visible_calendar(request, calendar_id)).data)


# -- GET /jobs/{id}/occurrences/ ---------------------------------------------------------
OCCURRENCES_WINDOW_MAX = dt.timedelta(days=400)


class OccurrencesQuery(serializers.Serializer):
    start = AwareDateTimeField(required=False, help_text="Inclusive; default a day ago.")
    end = AwareDateTimeField(required=False, help_text="Exclusive; default a week ahead.")
    cursor = serializers.CharField(required=False)
    limit = serializers.IntegerField(min_value=1, max_value=OCCURRENCES_PAGE_MAX, default=100)


class OccurrenceEntry(serializers.Serializer):
    scheduled_for = serializers.DateTimeField()
    local = serializers.CharField()
    decision = serializers.ChoiceField(
        choices=["ran", "running", "waiting", "skipped", "will_run", "will_skip"]
    )
    run = serializers.UUIDField(allow_null=True)
    state = serializers.CharField(allow_null=True)
    reasons = serializers.ListField(child=serializers.CharField())


class OccurrencesOutput(serializers.Serializer):
    next = serializers.CharField(allow_null=True)
    results = OccurrenceEntry(many=True)


class JobOccurrencesApi(APIView):
    @extend_schema(
        parameters=[
            OpenApiParameter("from", OpenApiTypes.DATETIME, description="Inclusive; default "
                             "a day ago. The window is at most 400 days."),
            OpenApiParameter("to", OpenApiTypes.DATETIME, description="Exclusive; default "
                             "a week ahead."),
            OpenApiParameter("cursor", OpenApiTypes.STR, description="From `next`."),
            OpenApiParameter("limit", OpenApiTypes.INT, description="1-500, default 100."),
        ],
        responses=OccurrencesOutput,
    )  # fmt: skip
    def get(self, request, job_id):
        job = visible_job(request, job_id)
        params = {key: value for key, value in request.query_params.items()}
        for alias, field in (("from", "start"), ("to", "end")):
            if alias in params:
                params[field] = params.pop(alias)
        query = OccurrencesQuery(data=params)
        query.is_valid(raise_exception=True)
        data, now = query.validated_data, db_now()
        start = (
            dt.datetime.fromisoformat(data["start"])
            if data.get("start")
            else now - dt.timedelta(days=1)
        )
        end = (
            dt.datetime.fromisoformat(data["end"])
            if data.get("end")
            else now + dt.timedelta(days=7)
        )
        if end <= start:
            raise serializers.ValidationError({"to": ["Must be later than from."]})
        if end - start > OCCURRENCES_WINDOW_MAX:
            raise serializers.ValidationError({"to": ["The window is at most 400 days."]})
        cursor = None
        if data.get("cursor"):
            try:
                cursor = cursor_decode(data["cursor"])
            except ValueError as exc:
                raise serializers.ValidationError({"cursor": [str(exc)]}) from exc
        page, last = job_occurrences(job=job, start=start, end=end, cursor=cursor,
                                     limit=data["limit"], now=now)  # fmt: skip
        following = None
        if last is not None:
            query_params = request.query_params.copy()
            query_params["cursor"] = cursor_encode(last)
            following = request.build_absolute_uri(f"{request.path}?{query_params.urlencode()}")
        return Response(OccurrencesOutput({"next": following, "results": page}).data)
