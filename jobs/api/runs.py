"""Runs: the lists (all visible runs, one job's), a run's detail with its history, and the
operator's actions on a run (cancel, replay)."""

from __future__ import annotations

from django.http import Http404
from drf_spectacular.utils import extend_schema, extend_schema_field
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from ..clock import db_now
from ..dependencies import dependency_upstream_runs
from ..models import RunKind, RunState
from ..selectors import run_get, run_history, run_list
from ..services import run_cancel_request, run_replay_request
from .base import NewestFirst, Problem, conflict, paginated, read_filters, visible_job
from .refusals import refusal
from .validation import AwareDateTimeField


class AttemptOutput(serializers.Serializer):
    number = serializers.IntegerField()
    state = serializers.CharField()
    fencing_token = serializers.IntegerField()
    worker = serializers.CharField()
    task_id = serializers.CharField()  # the delivering Celery task (AsyncResult's id)
    # None while reserved with its pack, not yet seen to start (docs/semantics.md).
    started_at = serializers.DateTimeField(allow_null=True)
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
    skip_reason = serializers.CharField(
        read_only=True, help_text="Why a skipped run did not run (misfire or overlap policy)."
    )
    result = serializers.JSONField(allow_null=True)
    duplicate_deliveries = serializers.IntegerField()
    upstream_runs = serializers.SerializerMethodField(
        help_text="The upstream runs whose ends created this run (schedule kind `after`)."
    )
    timestamps = serializers.SerializerMethodField()
    attempts = AttemptOutput(many=True)

    def get_upstream_runs(self, run) -> list[str]:
        return [str(run_id) for run_id in dependency_upstream_runs(run=run)]

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


class RunFilters(serializers.Serializer):
    job = serializers.UUIDField(required=False)
    state = serializers.ChoiceField(choices=RunState.values, required=False)
    kind = serializers.ChoiceField(choices=RunKind.values, required=False)
    scheduled_after = AwareDateTimeField(required=False, help_text="Inclusive.")
    scheduled_before = AwareDateTimeField(required=False, help_text="Exclusive.")
    ordering = serializers.ChoiceField(
        choices=["created_at", "-created_at", "scheduled_for", "-scheduled_for"],
        required=False,
        help_text="Default -created_at (newest first).",
    )


class JobRunFilters(RunFilters):
    """The run filters of one job's run list, whose job is in the path."""

    job = None


class JobRunListApi(APIView):
    pagination_class = NewestFirst

    @extend_schema(parameters=[JobRunFilters], responses=RunOutput(many=True))
    def get(self, request, job_id):
        visible_job(request, job_id)
        filters = {**read_filters(JobRunFilters, request), "job": job_id}
        return paginated(
            request, self, run_list(user=request.user, filters=filters), RunOutput, filters
        )


class RunListApi(APIView):
    pagination_class = NewestFirst

    @extend_schema(parameters=[RunFilters], responses=RunOutput(many=True))
    def get(self, request):
        filters = read_filters(RunFilters, request)
        return paginated(
            request, self, run_list(user=request.user, filters=filters), RunOutput, filters
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
        return RunEventOutput(run_history(run=run), many=True).data


class RunDetailApi(APIView):
    @extend_schema(responses=RunDetailOutput)
    def get(self, request, run_id):
        run = run_get(user=request.user, run_id=run_id)
        if run is None:
            raise Http404
        return Response(RunDetailOutput(run).data)


def _run_action(request, run_id, action, refused: str) -> Response:
    """An operator action on a run: 404 when not visible, 409 (the `refused` action's
    refusal, by the run's state) when the action is illegal in that state, else the run."""
    run = run_get(user=request.user, run_id=run_id)
    if run is None:
        raise Http404
    if not action(run=run, actor=request.user, now=db_now()):
        run.refresh_from_db()
        return conflict(refusal(refused, state=run.state), state=run.state)
    return Response(RunOutput(run_get(user=request.user, run_id=run_id)).data)


class RunCancelApi(APIView):
    @extend_schema(request=None, responses={200: RunOutput, 409: Problem})
    def post(self, request, run_id):
        return _run_action(request, run_id, run_cancel_request, "run.cancel")


class RunReplayApi(APIView):
    @extend_schema(request=None, responses={200: RunOutput, 409: Problem})
    def post(self, request, run_id):
        return _run_action(request, run_id, run_replay_request, "run.replay")
