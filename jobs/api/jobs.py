"""Jobs: the list and creation, a job's detail, change (If-Match) and deletion, its
history, and the operator's actions on a job (pause, resume, trigger, backfill, cancel)."""

from __future__ import annotations

import threading

from django.http import Http404
from drf_spectacular.utils import OpenApiExample, extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from .. import schedules
from ..clock import db_now, request_now
from ..dependencies import GRAPH_MAX_DEPTH, DependencyCycle, dependency_graph
from ..idempotency import Answer
from ..models import Job, JobState
from ..redaction import redact_value
from ..selectors import job_get, job_history, job_list, run_get
from ..services import (
    job_backfill,
    job_cancel,
    job_create_bulk,
    job_delete,
    job_is_editable,
    job_pause,
    job_resume,
    job_trigger,
    job_update,
)
from .base import (
    IDEMPOTENCY_KEY,
    IF_MATCH,
    ManagedNameTaken,
    NewestFirst,
    Problem,
    conflict,
    idempotent_response,
    managed_name_conflict,
    paginated,
    read_filters,
    unique_name_guard,
    visible_job,
)
from .refusals import refusal, schedule_refusal
from .runs import RunOutput
from .validation import (
    AwareDateTimeField,
    BackfillSerializer,
    JobSpecSerializer,
    backfill_instants,
    dependencies_check,
    job_patched_spec,
    job_spec_check,
)

# The scope of a job creation's Idempotency-Key. A bulk item's `idempotency_key` is the
# Idempotency-Key of a POST /jobs/ of its body: the same records, so either endpoint
# replays what the other created.
CREATE_SCOPE = "jobs.create"


class JobServerFields(serializers.Serializer):
    id = serializers.UUIDField()
    # A method field: a `source` naming a method is looked at with inspect.signature for
    # every job rendered.
    owner = serializers.SerializerMethodField()
    state = serializers.CharField()
    # A job read without its last outcome (one just created) has none yet.
    last_run_state = serializers.CharField(allow_null=True, default=None)
    last_run_at = serializers.DateTimeField(allow_null=True, default=None)
    version = serializers.IntegerField()
    next_run_at = serializers.DateTimeField(allow_null=True)
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()

    def get_owner(self, job) -> str:
        return job.owner.get_username()


class JobOutput(JobSpecSerializer):
    """The job body as validated, with every default, and the server-managed fields."""

    id = serializers.UUIDField(read_only=True)
    owner = serializers.CharField(read_only=True)
    state = serializers.ChoiceField(choices=JobState.values, read_only=True)
    last_run_state = serializers.ChoiceField(
        choices=["succeeded", "failed"],
        allow_null=True,
        read_only=True,
        help_text="How the job's latest finished run ended (succeeded or failed); null before "
        "any. A completed job whose last run failed shows `completed` with `failed` here.",
    )
    last_run_at = serializers.DateTimeField(
        allow_null=True, read_only=True, help_text="When that run finished."
    )
    version = serializers.IntegerField(read_only=True)
    next_run_at = serializers.DateTimeField(allow_null=True, read_only=True)
    created_at = serializers.DateTimeField(read_only=True)
    updated_at = serializers.DateTimeField(read_only=True)

    def to_representation(self, job):
        # One JobServerFields per thread for every job answered: building one deep-copies
        # its fields, which cost more than rendering a job (a creation answers one).
        server = getattr(_server_fields, "serializer", None)
        if server is None:
            server = _server_fields.serializer = JobServerFields()
        return {**_spec_shown(job, self.context.get("viewer")), **server.to_representation(job)}


_server_fields = threading.local()


def _spec_shown(job: Job, viewer) -> dict:
    """The spec as given to its owner (their own data); secrets masked for anyone else,
    operators included (docs/security.md). No viewer: the job's creator, answered."""
    if viewer is None or viewer.pk == job.owner_id:
        return job.spec
    return redact_value(job.spec)


class LabelField(serializers.CharField):
    """`key:value`, read as the pair (key, value)."""

    def to_internal_value(self, data):
        text = super().to_internal_value(data)
        key, colon, value = text.partition(":")
        if not colon or not key:
            raise serializers.ValidationError("Must be key:value, e.g. team:billing.")
        return key, value


class JobFilters(serializers.Serializer):
    state = serializers.ChoiceField(choices=JobState.values, required=False)
    task = serializers.CharField(required=False)
    queue = serializers.CharField(required=False)
    label = LabelField(required=False, help_text="key:value; jobs whose labels hold it.")
    created_after = AwareDateTimeField(required=False, help_text="Inclusive.")
    created_before = AwareDateTimeField(required=False, help_text="Exclusive.")
    ordering = serializers.ChoiceField(
        choices=["created_at", "-created_at", "name", "-name"],
        required=False,
        help_text="Default -created_at (newest first).",
    )


class DryRun(serializers.Serializer):
    dry_run = serializers.BooleanField(
        required=False,
        default=False,
        help_text="Validate only: answer 200 with the body as it would be stored (every "
        "default filled in), create nothing.",
    )


def _dry_run(request) -> bool:
    query = DryRun(data=request.query_params)
    query.is_valid(raise_exception=True)
    return query.validated_data["dry_run"]


class JobListApi(APIView):
    pagination_class = NewestFirst

    @extend_schema(parameters=[JobFilters], responses=JobOutput(many=True))
    def get(self, request):
        filters = read_filters(JobFilters, request)
        return paginated(
            request, self, job_list(user=request.user, filters=filters), JobOutput, filters
        )

    @extend_schema(
        request=JobSpecSerializer,
        parameters=[IDEMPOTENCY_KEY, DryRun],
        responses={201: JobOutput, 200: JobSpecSerializer, 409: Problem},
        examples=[
            OpenApiExample(
                "Weekday mornings in Berlin",
                request_only=True,
                value={
                    "name": "morning report",
                    "task": "scheduler.echo",
                    "kwargs": {"message": "good morning"},
                    "schedule": {
                        "kind": "cron",
                        "expression": "0 9 * * MON-FRI",
                        "timezone": "Europe/Berlin",
                    },
                    "overlap": "skip",
                    "misfire": {"policy": "run_latest", "grace_seconds": 300},
                },
            )
        ],
    )
    def post(self, request):
        now = request_now(request)
        if _dry_run(request):
            # The body as it would be stored, every default filled in; nothing written, no
            # key recorded (`schedctl apply` compares it with a job's spec).
            spec, _first = job_spec_check(request.data, now=now)
            return Response(spec)

        def create() -> Answer:
            spec, first = job_spec_check(request.data, now=now)
            dependencies_check(spec=spec, visible=lambda: job_list(user=request.user))
            try:
                # job_create's rows, written in one statement rather than three.
                [job] = unique_name_guard(
                    lambda: job_create_bulk(
                        owner=request.user, specs=[spec], first_fires=[first], now=now, bulk=False
                    ),
                    specs=[spec],
                )
            except ManagedNameTaken:
                answer = managed_name_conflict(owner=request.user, name=spec["name"])
                return Answer(answer.status_code, answer.data)
            return Answer(status.HTTP_201_CREATED, JobOutput(job).data)

        # A creation only inserts new rows: its key is recorded after it (one statement).
        return idempotent_response(
            request, scope=CREATE_SCOPE, produce=create, now=now, lockless=True
        )


def _version_header(header: str | None) -> int | None:
    """`If-Match: 3`, `"3"` or `W/"3"` -> 3; None when absent; 400 when unreadable."""
    if header is None:
        return None
    text = header.strip().removeprefix("W/").strip('"')
    if not text.isdigit():
        raise serializers.ValidationError(
            {"If-Match": ["Must be the job's version, an integer (e.g. If-Match: 3)."]}
        )
    return int(text)


def _with_etag(response: Response, job) -> Response:
    response["ETag"] = f'"{job.version}"'
    return response


class JobDetailApi(APIView):
    @extend_schema(responses=JobOutput)
    def get(self, request, job_id):
        job = visible_job(request, job_id)
        return _with_etag(Response(JobOutput(job, context={"viewer": request.user}).data), job)

    @extend_schema(
        request=JobSpecSerializer(partial=True),
        parameters=[IF_MATCH],
        responses={200: JobOutput, 409: Problem, 412: Problem},
    )
    def patch(self, request, job_id):
        job = visible_job(request, job_id)
        expected = _version_header(request.headers.get("If-Match"))
        if expected is not None and expected != job.version:
            return _stale(job)
        # State first: no correction of the body would make a change of this job legal.
        if not job_is_editable(job=job):
            return conflict(refusal("job.change", state=job.state), state=job.state)
        spec = job_patched_spec(spec=job.spec, patch=request.data)
        dependencies_check(spec=spec, visible=job_list(user=request.user), job_id=job.id)
        try:
            updated = unique_name_guard(
                lambda: job_update(
                    job=job,
                    spec=spec,
                    expected_version=job.version,
                    actor=request.user,
                    now=db_now(),
                )
            )
        except ManagedNameTaken:
            return managed_name_conflict(owner=job.owner, name=spec["name"])
        except DependencyCycle as exc:  # closed by a concurrent edit since the check
            raise serializers.ValidationError(
                {"schedule": {"jobs": ["Would make a cycle with a concurrent edit."]}}
            ) from exc
        if not updated:
            job = visible_job(request, job_id)
            if not job_is_editable(job=job):
                return conflict(refusal("job.change", state=job.state), state=job.state)
            return _stale(job)
        job = visible_job(request, job_id)
        return _with_etag(Response(JobOutput(job, context={"viewer": request.user}).data), job)

    @extend_schema(request=None, responses={204: None})
    def delete(self, request, job_id):
        job = visible_job(request, job_id)
        if not job_delete(job=job, actor=request.user, now=db_now()):
            raise Http404  # deleted meanwhile
        return Response(status=status.HTTP_204_NO_CONTENT)


def _stale(job) -> Response:
    return _with_etag(
        Response(
            {"detail": f"the job is at version {job.version}", "version": job.version},
            status=status.HTTP_412_PRECONDITION_FAILED,
        ),
        job,
    )


class JobPauseApi(APIView):
    @extend_schema(request=None, responses={200: JobOutput, 409: Problem})
    def post(self, request, job_id):
        job = visible_job(request, job_id)
        if not job_pause(job=job, actor=request.user, now=db_now()):
            job.refresh_from_db()
            return conflict(refusal("job.pause", state=job.state), state=job.state)
        job = visible_job(request, job_id)
        return Response(JobOutput(job, context={"viewer": request.user}).data)


class JobResumeApi(APIView):
    @extend_schema(request=None, responses={200: JobOutput, 409: Problem})
    def post(self, request, job_id):
        job = visible_job(request, job_id)
        try:
            resumed = job_resume(job=job, actor=request.user, now=db_now())
        except schedules.ScheduleError as exc:
            return conflict(schedule_refusal(exc), state=job.state)
        if not resumed:
            job.refresh_from_db()
            return conflict(refusal("job.resume", state=job.state), state=job.state)
        job = visible_job(request, job_id)
        return Response(JobOutput(job, context={"viewer": request.user}).data)


class JobTriggerApi(APIView):
    @extend_schema(
        request=None, parameters=[IDEMPOTENCY_KEY], responses={201: RunOutput, 409: Problem}
    )
    def post(self, request, job_id):
        job = visible_job(request, job_id)

        def trigger() -> Answer:
            run = job_trigger(job=job, actor=request.user, now=db_now())
            if run is None:
                job.refresh_from_db()
                return Answer(
                    status.HTTP_409_CONFLICT,
                    {"detail": refusal("job.trigger", state=job.state), "state": job.state},
                )
            return Answer(
                status.HTTP_201_CREATED, RunOutput(run_get(user=request.user, run_id=run.id)).data
            )

        return idempotent_response(request, scope=f"jobs.{job.id}.trigger", produce=trigger)


class BackfillOutput(serializers.Serializer):
    created = serializers.ListField(child=serializers.UUIDField(), help_text="New runs.")
    existing = serializers.ListField(
        child=serializers.UUIDField(), help_text="Runs an earlier backfill already created."
    )
    pruned = serializers.ListField(
        child=serializers.DateTimeField(),
        help_text="Occurrences an earlier backfill ran whose runs retention has deleted since: "
        "not run again.",
    )


class JobBackfillApi(APIView):
    throttle_scope = "backfill"  # jobs.throttling: tighter than the per-user rate

    @extend_schema(
        request=BackfillSerializer,
        parameters=[IDEMPOTENCY_KEY],
        examples=[
            OpenApiExample(
                "One day of 2025",
                request_only=True,
                value={"start": "2025-01-01T00:00:00Z", "end": "2025-01-02T00:00:00Z"},
            )
        ],
        responses={201: BackfillOutput, 409: Problem},
    )
    def post(self, request, job_id):
        job = visible_job(request, job_id)

        def backfill() -> Answer:
            now = db_now()
            window = BackfillSerializer(data=request.data, context={"now": now})
            window.is_valid(raise_exception=True)
            instants = backfill_instants(job=job, **window.validated_data)
            result = job_backfill(job=job, instants=instants, actor=request.user, now=now)
            if result is None:
                job.refresh_from_db()
                return Answer(
                    status.HTTP_409_CONFLICT,
                    {"detail": refusal("job.backfill", state=job.state), "state": job.state},
                )
            body = BackfillOutput(
                {
                    "created": [r.id for r in result.created],
                    "existing": [r.id for r in result.existing],
                    "pruned": result.pruned,
                }
            ).data
            return Answer(status.HTTP_201_CREATED, body)

        return idempotent_response(request, scope=f"jobs.{job.id}.backfill", produce=backfill)


class VersionOutput(serializers.Serializer):
    version = serializers.IntegerField()
    created_at = serializers.DateTimeField()
    created_by = serializers.CharField(allow_null=True)
    spec = serializers.JSONField()
    changes = serializers.ListField(
        child=serializers.DictField(),
        help_text="[{field, from, to}] against the previous version; nested fields dotted.",
    )


class EventOutput(serializers.Serializer):
    created_at = serializers.DateTimeField()
    actor = serializers.CharField(source="actor_label")
    action = serializers.CharField()
    run = serializers.UUIDField(source="run_id", allow_null=True)
    data = serializers.JSONField()


class HistoryOutput(serializers.Serializer):
    versions = VersionOutput(many=True, help_text="The newest 100, newest first.")
    more_versions = serializers.BooleanField(help_text="Older versions exist.")
    events = EventOutput(
        many=True, help_text="The newest 1,000 events of the job and its runs, newest first."
    )
    more_events = serializers.BooleanField(help_text="Older events exist.")


class JobHistoryApi(APIView):
    @extend_schema(responses=HistoryOutput)
    def get(self, request, job_id):
        job = visible_job(request, job_id)
        # An operator's read gets the secrets masked; the owner's, their own data.
        history = job_history(job=job, redacted=request.user.pk != job.owner_id)
        return Response(HistoryOutput(history).data)


class GraphJobOutput(serializers.Serializer):
    id = serializers.UUIDField()
    name = serializers.CharField()
    state = serializers.CharField()
    depth = serializers.IntegerField(help_text="Edges from the job asked about.")


class GraphOutput(serializers.Serializer):
    job = serializers.UUIDField()
    upstream = GraphJobOutput(many=True, help_text="The jobs it runs after, transitively.")
    downstream = GraphJobOutput(many=True, help_text="The jobs that run after it, transitively.")
    max_depth = serializers.IntegerField()


class JobGraphApi(APIView):
    @extend_schema(responses=GraphOutput)
    def get(self, request, job_id):
        job = visible_job(request, job_id)
        graph = dependency_graph(job=job, visible=job_list(user=request.user))
        return Response(GraphOutput({"job": job.id, **graph, "max_depth": GRAPH_MAX_DEPTH}).data)


class JobCancelApi(APIView):
    @extend_schema(request=None, responses={200: JobOutput, 409: Problem})
    def post(self, request, job_id):
        job = job_get(user=request.user, job_id=job_id)
        if job is None:
            raise Http404
        if not job_cancel(job=job, actor=request.user, now=db_now()):
            job.refresh_from_db()
            return conflict(refusal("job.cancel", state=job.state), state=job.state)
        job = job_get(user=request.user, job_id=job_id)
        return Response(JobOutput(job, context={"viewer": request.user}).data)
