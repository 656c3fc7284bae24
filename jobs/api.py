"""REST API v1: one class per path; each validates, calls one service or selector, serializes."""

from __future__ import annotations

from django.http import Http404
from drf_spectacular.utils import extend_schema, extend_schema_field
from rest_framework import serializers, status
from rest_framework.pagination import CursorPagination
from rest_framework.response import Response
from rest_framework.views import APIView

from dispatch.clock import db_now

from .models import AuditEvent, JobState, RunKind, RunState
from .selectors import job_get, job_list, run_get, run_list
from .services import job_cancel, job_create, run_cancel_request, run_replay_request
from .validation import JobSpecSerializer


class NewestFirst(CursorPagination):
    page_size = 50
    max_page_size = 500
    page_size_query_param = "page_size"
    ordering = ("-created_at", "-id")


class JobOutput(serializers.Serializer):
    id = serializers.UUIDField()
    owner = serializers.CharField(source="owner.get_username")
    state = serializers.CharField()
    version = serializers.IntegerField()
    next_run_at = serializers.DateTimeField(allow_null=True)
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()
    spec = serializers.JSONField(help_text="The job body as validated, with every default.")

    def to_representation(self, job):
        data = super().to_representation(job)
        return {**data.pop("spec"), **data}


class AttemptOutput(serializers.Serializer):
    number = serializers.IntegerField()
    state = serializers.CharField()
    fencing_token = serializers.IntegerField()
    worker = serializers.CharField()
    started_at = serializers.DateTimeField()
    heartbeat_at = serializers.DateTimeField()
    lease_expires_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField(allow_null=True)
    error = serializers.CharField()


class RunOutput(serializers.Serializer):
    id = serializers.UUIDField()
    job = serializers.UUIDField(source="job_id")
    job_version = serializers.IntegerField(source="job_version.version")
    kind = serializers.CharField()
    state = serializers.CharField()
    scheduled_for = serializers.DateTimeField()
    idempotency_key = serializers.CharField()
    attempt_count = serializers.IntegerField()
    fencing_token = serializers.IntegerField()
    next_attempt_at = serializers.DateTimeField(allow_null=True)
    failure_reason = serializers.CharField()
    result = serializers.JSONField(allow_null=True)
    duplicate_deliveries = serializers.IntegerField()
    timestamps = serializers.SerializerMethodField()
    attempts = AttemptOutput(many=True)

    def get_timestamps(self, run) -> dict:
        field = serializers.DateTimeField()
        stages = {
            "due": run.due_at,
            "created": run.created_at,
            "published": run.published_at,
            "started": run.started_at,
            "finished": run.finished_at,
        }
        return {stage: field.to_representation(at) if at else None for stage, at in stages.items()}


class JobFilters(serializers.Serializer):
    state = serializers.ChoiceField(choices=JobState.values, required=False)
    task = serializers.CharField(required=False)
    queue = serializers.CharField(required=False)


class RunFilters(serializers.Serializer):
    job = serializers.UUIDField(required=False)
    state = serializers.ChoiceField(choices=RunState.values, required=False)
    kind = serializers.ChoiceField(choices=RunKind.values, required=False)
    scheduled_after = serializers.DateTimeField(required=False)
    scheduled_before = serializers.DateTimeField(required=False)


def _filters(serializer_class, request) -> dict:
    filters = serializer_class(data=request.query_params)
    filters.is_valid(raise_exception=True)
    return filters.validated_data


def _page(request, view, queryset, output):
    paginator = NewestFirst()
    page = paginator.paginate_queryset(queryset, request, view=view)
    return paginator.get_paginated_response(output(page, many=True).data)


class JobListApi(APIView):
    @extend_schema(parameters=[JobFilters], responses=JobOutput(many=True))
    def get(self, request):
        return _page(
            request,
            self,
            job_list(user=request.user, filters=_filters(JobFilters, request)),
            JobOutput,
        )

    @extend_schema(request=JobSpecSerializer, responses={201: JobOutput})
    def post(self, request):
        spec = JobSpecSerializer(data=request.data)
        spec.is_valid(raise_exception=True)
        job = job_create(owner=request.user, spec=dict(spec.validated_data), now=db_now())
        return Response(JobOutput(job).data, status=status.HTTP_201_CREATED)


class JobDetailApi(APIView):
    @extend_schema(responses=JobOutput)
    def get(self, request, job_id):
        job = job_get(user=request.user, job_id=job_id)
        if job is None:
            raise Http404
        return Response(JobOutput(job).data)


class JobRunListApi(APIView):
    @extend_schema(parameters=[RunFilters], responses=RunOutput(many=True))
    def get(self, request, job_id):
        if job_get(user=request.user, job_id=job_id) is None:
            raise Http404
        filters = {**_filters(RunFilters, request), "job": job_id}
        return _page(request, self, run_list(user=request.user, filters=filters), RunOutput)


class RunListApi(APIView):
    @extend_schema(parameters=[RunFilters], responses=RunOutput(many=True))
    def get(self, request):
        return _page(
            request,
            self,
            run_list(user=request.user, filters=_filters(RunFilters, request)),
            RunOutput,
        )


class RunEventOutput(serializers.Serializer):
    at = serializers.DateTimeField(source="created_at")
    actor = serializers.CharField(source="actor_label")
    action = serializers.CharField()
    data = serializers.JSONField()


class RunDetailOutput(RunOutput):
    history = serializers.SerializerMethodField()

    @extend_schema_field(RunEventOutput(many=True))
    def get_history(self, run) -> list:
        """What happened to the run besides its attempts, oldest first: cancels, replays,
        lost and timed-out attempts, refused duplicates, reconciliation's repairs."""
        events = AuditEvent.objects.filter(run=run).order_by("created_at", "id")[:500]
        return RunEventOutput(events, many=True).data


class RunDetailApi(APIView):
    @extend_schema(responses=RunDetailOutput)
    def get(self, request, run_id):
        run = run_get(user=request.user, run_id=run_id)
        if run is None:
            raise Http404
        return Response(RunDetailOutput(run).data)


def _conflict(detail: str, *, state: str) -> Response:
    return Response({"detail": detail, "state": state}, status=status.HTTP_409_CONFLICT)


class JobCancelApi(APIView):
    @extend_schema(request=None, responses={200: JobOutput, 409: dict})
    def post(self, request, job_id):
        job = job_get(user=request.user, job_id=job_id)
        if job is None:
            raise Http404
        if not job_cancel(job=job, actor=request.user, now=db_now()):
            job.refresh_from_db()
            return _conflict(f"a {job.state} job cannot be cancelled", state=job.state)
        return Response(JobOutput(job_get(user=request.user, job_id=job_id)).data)


class RunCancelApi(APIView):
    @extend_schema(request=None, responses={200: RunOutput, 409: dict})
    def post(self, request, run_id):
        run = run_get(user=request.user, run_id=run_id)
        if run is None:
            raise Http404
        if not run_cancel_request(run=run, actor=request.user, now=db_now()):
            run.refresh_from_db()
            return _conflict(f"a {run.state} run cannot be cancelled", state=run.state)
        return Response(RunOutput(run_get(user=request.user, run_id=run_id)).data)


class RunReplayApi(APIView):
    @extend_schema(request=None, responses={200: RunOutput, 409: dict})
    def post(self, request, run_id):
        run = run_get(user=request.user, run_id=run_id)
        if run is None:
            raise Http404
        if not run_replay_request(run=run, actor=request.user, now=db_now()):
            run.refresh_from_db()
            return _conflict(
                f"only a failed or cancelled run can be replayed, not a {run.state} one",
                state=run.state,
            )
        return Response(RunOutput(run_get(user=request.user, run_id=run_id)).data)
