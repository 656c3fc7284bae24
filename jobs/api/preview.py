"""POST /schedules/preview/: a schedule's next occurrences, DST shifts and folds named."""

from __future__ import annotations

import datetime as dt

from drf_spectacular.utils import OpenApiExample, extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from .. import schedules
from ..calendar_services import calendar_list
from ..calendars import CalendarView
from ..clock import db_now
from ..dependencies import dependency_preview
from ..occurrences import JobCalendars, occurrence_decide
from ..selectors import job_list
from .validation import PreviewSerializer, dependencies_check


class OccurrenceOutput(serializers.Serializer):
    at = serializers.DateTimeField(help_text="UTC.")
    local = serializers.CharField(help_text="ISO 8601 in the schedule's zone, with offset.")
    dst = serializers.ChoiceField(
        choices=["", "gap_shifted", "fold_first", "fold_second"],
        help_text="gap_shifted: moved to the end of a spring-forward gap; fold_first / "
        "fold_second: one of the two instants of a repeated local time.",
    )
    doubled = serializers.BooleanField(
        help_text="The same local time fires twice (fold: both, or auto with a wildcard hour)."
    )
    excluded = serializers.BooleanField(
        required=False,
        help_text="Only with `calendars`: the calendars would skip it; see `reason`.",
    )
    reason = serializers.CharField(
        required=False, help_text="Only with `calendars`: the `calendar:` skip reason, or ''."
    )


class PreviewOutput(serializers.Serializer):
    occurrences = OccurrenceOutput(many=True)
    note = serializers.CharField(
        required=False,
        help_text="For a schedule of kind `after`: what its instants mean.",
    )


AFTER_NOTE = (
    "An `after` schedule has no times of its own: these are the instants at which every "
    "upstream has an occurrence (its runs' scheduled_for). Each runs when its upstream runs "
    "end as `on` asks, and is skipped otherwise."
)


class SchedulePreviewApi(APIView):
    @extend_schema(
        request=PreviewSerializer,
        responses=PreviewOutput,
        examples=[
            OpenApiExample(
                "02:30 daily in New York across spring forward",
                request_only=True,
                value={
                    "schedule": {
                        "kind": "cron",
                        "expression": "30 2 * * *",
                        "timezone": "America/New_York",
                    },
                    "dst": {"gap": "shift", "fold": "auto"},
                    "after": "2025-03-08T00:00:00Z",
                    "count": 3,
                },
            )
        ],
    )
    def post(self, request):
        preview = PreviewSerializer(data=request.data)
        preview.is_valid(raise_exception=True)
        data = preview.validated_data
        after = dt.datetime.fromisoformat(data["after"]) if data.get("after") else db_now()
        if data["schedule"]["kind"] == "after":
            return self._after(request, data, after)
        calendars = None
        if data.get("calendars"):
            calendars = preview_calendars(user=request.user, named=data["calendars"])
        try:
            found = schedules.schedule_preview(
                schedule=data["schedule"], dst=data["dst"], after=after, count=data["count"]
            )
        except schedules.ScheduleError as exc:
            raise serializers.ValidationError({"schedule": [str(exc)]}) from exc
        for fire in found if calendars is not None else ():
            fire["reason"] = occurrence_decide(at=fire["at"], calendars=calendars).skip_reason
            fire["excluded"] = bool(fire["reason"])
        return Response(PreviewOutput({"occurrences": found}).data)

    def _after(self, request, data: dict, after: dt.datetime) -> Response:
        visible = job_list(user=request.user)
        dependencies_check(spec={"schedule": data["schedule"]}, visible=visible)
        upstreams = list(visible.filter(id__in=data["schedule"]["jobs"]))
        instants = dependency_preview(
            upstreams=upstreams, visible=visible, after=after, count=data["count"]
        )
        found = [
            {"at": at, "local": at.isoformat(), "dst": "", "doubled": False} for at in instants
        ]
        return Response(PreviewOutput({"occurrences": found, "note": AFTER_NOTE}).data)


def preview_calendars(*, user, named: dict) -> JobCalendars:
    """The caller's calendars a draft names; 400 for one the caller cannot see."""
    ids = [i for role in ("exclude", "only") for i in named.get(role, ())]
    views = {
        str(calendar.id): CalendarView(id=str(calendar.id), name=calendar.name, spec=calendar.spec)
        for calendar in calendar_list(user=user).filter(owner=user, id__in=ids)
    }
    missing = [i for i in ids if i not in views]
    if missing:
        raise serializers.ValidationError(
            {"calendars": [f"calendar {missing[0]} is not one of yours"]}
        )
    return JobCalendars.of({"calendars": named}, views)
