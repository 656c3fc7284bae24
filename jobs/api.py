"""REST API v1: one class per path; each validates, calls one service or selector, serializes."""

from __future__ import annotations

import datetime as dt

from django.db import transaction
from django.http import Http404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiExample,
    OpenApiParameter,
    extend_schema,
    extend_schema_field,
)
from rest_framework import serializers, status
from rest_framework.pagination import CursorPagination
from rest_framework.response import Response
from rest_framework.views import APIView, exception_handler

from . import schedules
from .clock import db_now
from .idempotency import (
    MAX_KEY_LENGTH,
    Answer,
    IdempotencyConflict,
    idempotency_claim,
    idempotency_key_problem,
    idempotency_store,
    idempotent_answer,
    request_hash,
)
from .models import Job, JobState, RunKind, RunState
from .redaction import redact_value
from .refusals import refusal, schedule_refusal
from .selectors import job_get, job_history, job_list, run_get, run_history, run_list
from .services import (
    JobQuotaExceeded,
    job_backfill,
    job_cancel,
    job_create_bulk,
    job_delete,
    job_is_editable,
    job_pause,
    job_resume,
    job_trigger,
    job_update,
    run_cancel_request,
    run_replay_request,
)
from .validation import (
    AwareDateTimeField,
    BackfillSerializer,
    JobSpecSerializer,
    PreviewSerializer,
    backfill_instants,
    job_patched_spec,
    job_spec_check,
)


def api_exception_handler(exc, context):
    """DRF's, plus the domain's refusals that are not bad input: an owner over its job
    quota answers 429 (SPEC, "Security"); the transaction of the request rolled back."""
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


class JobServerFields(serializers.Serializer):
    id = serializers.UUIDField()
    owner = serializers.CharField(source="owner.get_username")
    state = serializers.CharField()
    version = serializers.IntegerField()
    next_run_at = serializers.DateTimeField(allow_null=True)
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()


class JobOutput(JobSpecSerializer):
    """The job body as validated, with every default, and the server-managed fields."""

    id = serializers.UUIDField(read_only=True)
    owner = serializers.CharField(read_only=True)
    state = serializers.ChoiceField(choices=JobState.values, read_only=True)
    version = serializers.IntegerField(read_only=True)
    next_run_at = serializers.DateTimeField(allow_null=True, read_only=True)
    created_at = serializers.DateTimeField(read_only=True)
    updated_at = serializers.DateTimeField(read_only=True)

    def to_representation(self, job):
        # One JobServerFields for every job of a list: building one copies its fields.
        server = getattr(self, "_server_fields", None)
        if server is None:
            server = self._server_fields = JobServerFields()
        return {**_spec_shown(job, self.context.get("viewer")), **server.to_representation(job)}


def _spec_shown(job: Job, viewer) -> dict:
    """The spec as given to its owner (their own data); secrets masked for anyone else,
    operators included (SPEC, "Security"). No viewer: the job's creator, answered."""
    if viewer is None or viewer.pk == job.owner_id:
        return job.spec
    return redact_value(job.spec)


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


def _filters(serializer_class, request) -> dict:
    filters = serializer_class(data=request.query_params)
    filters.is_valid(raise_exception=True)
    return filters.validated_data


def _page(request, view, queryset, output, filters: dict):
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


def _answer(
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


def _visible_job(request, job_id):
    job = job_get(user=request.user, job_id=job_id)
    if job is None:
        raise Http404
    return job


class JobListApi(APIView):
    pagination_class = NewestFirst

    @extend_schema(parameters=[JobFilters], responses=JobOutput(many=True))
    def get(self, request):
        filters = _filters(JobFilters, request)
        return _page(
            request, self, job_list(user=request.user, filters=filters), JobOutput, filters
        )

    @extend_schema(
        request=JobSpecSerializer,
        parameters=[IDEMPOTENCY_KEY],
        responses={201: JobOutput, 409: Problem},
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
        now = db_now()

        def create() -> Answer:
            spec, first = job_spec_check(request.data, now=now)
            # job_create's rows, written in one statement rather than three.
            [job] = job_create_bulk(
                owner=request.user, specs=[spec], first_fires=[first], now=now, bulk=False
            )
            return Answer(status.HTTP_201_CREATED, JobOutput(job).data)

        # A creation only inserts new rows: its key is recorded after it (one statement).
        return _answer(request, scope=CREATE_SCOPE, produce=create, now=now, lockless=True)


# A bulk item's `idempotency_key` is the Idempotency-Key of a POST /jobs/ of its body: the
# same records, so either endpoint replays what the other created.
CREATE_SCOPE = "jobs.create"
BULK_MAX_JOBS = 1000


class BulkItemSerializer(JobSpecSerializer):
    """A job body with an optional `idempotency_key` (for the schema; see JobBulkApi)."""

    idempotency_key = serializers.CharField(
        required=False,
        max_length=MAX_KEY_LENGTH,
        help_text="As the Idempotency-Key header of POST /jobs/, for this item.",
    )


class BulkOutput(serializers.Serializer):
    jobs = JobOutput(many=True, help_text="Aligned with the request's items.")
    replayed = serializers.ListField(
        child=serializers.BooleanField(),
        help_text="Per item: true when its idempotency_key answered with the job it created "
        "earlier.",
    )


class BulkErrors(serializers.Serializer):
    detail = serializers.CharField()
    errors = serializers.ListField(
        required=False,
        child=serializers.DictField(allow_null=True),
        help_text="Aligned with the request's items: null for a valid item, else its "
        "errors by field, as POST /jobs/ would answer them. Absent when the body as a whole "
        "is refused (not an array, too many items).",
    )


def _bulk_items(data, *, now: dt.datetime) -> tuple[list, list, list, list]:
    """(specs, first fires, keys, errors), each aligned with the items; validation without
    the database."""
    specs, firsts, keys, errors, seen = [], [], [], [], {}
    for index, item in enumerate(data):
        spec = key = error = first = None
        if not isinstance(item, dict):
            error = {"non_field_errors": ["Must be a JSON object (a job body)."]}
        else:
            body = dict(item)
            key = body.pop("idempotency_key", None)
            if key is not None:
                text = isinstance(key, str)
                problem = idempotency_key_problem(key) if text else "Must be a string."
                if problem is None and key in seen:
                    problem = f"Item {seen[key]} of this request has the same key."
                if problem:
                    error, key = {"idempotency_key": [problem]}, None
                else:
                    seen[key] = index
            try:
                spec, first = job_spec_check(body, now=now)
            except serializers.ValidationError as exc:
                error = {**exc.detail, **(error or {})}
            if error:
                spec = None
        specs.append(spec)
        firsts.append(first)
        keys.append(key)
        errors.append(error)
    return specs, firsts, keys, errors


class JobBulkApi(APIView):
    throttle_scope = "bulk"  # jobs.throttling: tighter than the per-user rate

    @extend_schema(
        request=BulkItemSerializer(many=True),
        responses={201: BulkOutput, 400: BulkErrors, 409: BulkErrors},
        examples=[
            OpenApiExample(
                "Two jobs, one with a key",
                request_only=True,
                value=[
                    {
                        "name": "report 1",
                        "task": "scheduler.echo",
                        "schedule": {"kind": "cron", "expression": "0 9 * * *"},
                        "idempotency_key": "report-1",
                    },
                    {
                        "name": "once",
                        "task": "scheduler.echo",
                        "schedule": {"kind": "once", "run_at": "2030-01-01T00:00:00Z"},
                    },
                ],
            )
        ],
    )
    def post(self, request):
        if not isinstance(request.data, list):
            return _bulk_problem("Must be a JSON array of job bodies.")
        if len(request.data) > BULK_MAX_JOBS:
            return _bulk_problem(
                f"At most {BULK_MAX_JOBS} jobs per request, not {len(request.data)}."
            )
        now = db_now()
        specs, firsts, keys, errors = _bulk_items(request.data, now=now)
        digests = {
            key: request_hash({k: v for k, v in item.items() if k != "idempotency_key"})
            for key, item in zip(keys, request.data, strict=True)
            if key is not None
        }
        with transaction.atomic():
            earlier = idempotency_claim(
                owner=request.user, scope=CREATE_SCOPE, digests=digests, now=now
            )
            for index, key in enumerate(keys):
                if key in earlier:
                    if earlier[key].request_hash == digests[key]:
                        errors[index] = None  # replayed: its body is the one already accepted
                    else:
                        errors[index] = {"idempotency_key": [
                            f"'{key}' was already used with another request body."]}  # fmt: skip
            if any(errors):
                transaction.set_rollback(True)
                return _bulk_refusal(errors, keys, earlier)
            fresh = [index for index, key in enumerate(keys) if key not in earlier]
            jobs = job_create_bulk(
                owner=request.user,
                specs=[specs[index] for index in fresh],
                first_fires=[firsts[index] for index in fresh],
                now=now,
            )
            bodies = JobOutput(jobs, many=True).data
            answers = [earlier[key].response_body if key in earlier else None for key in keys]
            for index, body in zip(fresh, bodies, strict=True):
                answers[index] = body
            idempotency_store(
                owner=request.user,
                scope=CREATE_SCOPE,
                status=status.HTTP_201_CREATED,
                bodies={keys[index]: answers[index] for index in fresh if keys[index]},
            )
        return Response(
            {"jobs": answers, "replayed": [key in earlier for key in keys]},
            status=status.HTTP_201_CREATED,
        )


def _bulk_problem(detail: str) -> Response:
    return Response({"detail": detail}, status=status.HTTP_400_BAD_REQUEST)


def _bulk_refusal(errors: list, keys: list, earlier: dict) -> Response:
    """400 naming each bad item; 409 when the only problems are keys used with other bodies."""
    bad = [index for index, error in enumerate(errors) if error]
    conflicts = all(keys[index] in earlier and set(errors[index]) == {"idempotency_key"}
                    for index in bad)  # fmt: skip
    return Response(
        {
            "detail": f"{len(bad)} of {len(errors)} jobs refused; none was created.",
            "errors": errors,
        },
        status=status.HTTP_409_CONFLICT if conflicts else status.HTTP_400_BAD_REQUEST,
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
        job = _visible_job(request, job_id)
        return _with_etag(Response(JobOutput(job, context={"viewer": request.user}).data), job)

    @extend_schema(
        request=JobSpecSerializer(partial=True),
        parameters=[IF_MATCH],
        responses={200: JobOutput, 409: Problem, 412: Problem},
    )
    def patch(self, request, job_id):
        job = _visible_job(request, job_id)
        expected = _version_header(request.headers.get("If-Match"))
        if expected is not None and expected != job.version:
            return _stale(job)
        # State first: no correction of the body would make a change of this job legal.
        if not job_is_editable(job=job):
            return _conflict(refusal("job.change", state=job.state), state=job.state)
        spec = job_patched_spec(spec=job.spec, patch=request.data)
        if not job_update(
            job=job, spec=spec, expected_version=job.version, actor=request.user, now=db_now()
        ):
            job = _visible_job(request, job_id)
            if not job_is_editable(job=job):
                return _conflict(refusal("job.change", state=job.state), state=job.state)
            return _stale(job)
        job = _visible_job(request, job_id)
        return _with_etag(Response(JobOutput(job, context={"viewer": request.user}).data), job)

    @extend_schema(request=None, responses={204: None})
    def delete(self, request, job_id):
        job = _visible_job(request, job_id)
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


class JobRunListApi(APIView):
    pagination_class = NewestFirst

    @extend_schema(parameters=[JobRunFilters], responses=RunOutput(many=True))
    def get(self, request, job_id):
        _visible_job(request, job_id)
        filters = {**_filters(JobRunFilters, request), "job": job_id}
        return _page(
            request, self, run_list(user=request.user, filters=filters), RunOutput, filters
        )


class RunListApi(APIView):
    pagination_class = NewestFirst

    @extend_schema(parameters=[RunFilters], responses=RunOutput(many=True))
    def get(self, request):
        filters = _filters(RunFilters, request)
        return _page(
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


def _conflict(detail: str, *, state: str) -> Response:
    return Response({"detail": detail, "state": state}, status=status.HTTP_409_CONFLICT)


class JobPauseApi(APIView):
    @extend_schema(request=None, responses={200: JobOutput, 409: Problem})
    def post(self, request, job_id):
        job = _visible_job(request, job_id)
        if not job_pause(job=job, actor=request.user, now=db_now()):
            job.refresh_from_db()
            return _conflict(refusal("job.pause", state=job.state), state=job.state)
        job = _visible_job(request, job_id)
        return Response(JobOutput(job, context={"viewer": request.user}).data)


class JobResumeApi(APIView):
    @extend_schema(request=None, responses={200: JobOutput, 409: Problem})
    def post(self, request, job_id):
        job = _visible_job(request, job_id)
        try:
            resumed = job_resume(job=job, actor=request.user, now=db_now())
        except schedules.ScheduleError as exc:
            return _conflict(schedule_refusal(exc), state=job.state)
        if not resumed:
            job.refresh_from_db()
            return _conflict(refusal("job.resume", state=job.state), state=job.state)
        job = _visible_job(request, job_id)
        return Response(JobOutput(job, context={"viewer": request.user}).data)


class JobTriggerApi(APIView):
    @extend_schema(
        request=None, parameters=[IDEMPOTENCY_KEY], responses={201: RunOutput, 409: Problem}
    )
    def post(self, request, job_id):
        job = _visible_job(request, job_id)

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

        return _answer(request, scope=f"jobs.{job.id}.trigger", produce=trigger)


class BackfillOutput(serializers.Serializer):
    created = serializers.ListField(child=serializers.UUIDField(), help_text="New runs.")
    existing = serializers.ListField(
        child=serializers.UUIDField(), help_text="Runs an earlier backfill already created."
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
        job = _visible_job(request, job_id)

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
                }
            ).data
            return Answer(status.HTTP_201_CREATED, body)

        return _answer(request, scope=f"jobs.{job.id}.backfill", produce=backfill)


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
        job = _visible_job(request, job_id)
        # An operator's read gets the secrets masked; the owner's, their own data.
        history = job_history(job=job, redacted=request.user.pk != job.owner_id)
        return Response(HistoryOutput(history).data)


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


class PreviewOutput(serializers.Serializer):
    occurrences = OccurrenceOutput(many=True)


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
        try:
            found = schedules.schedule_preview(
                schedule=data["schedule"], dst=data["dst"], after=after, count=data["count"]
            )
        except schedules.ScheduleError as exc:
            raise serializers.ValidationError({"schedule": [str(exc)]}) from exc
        return Response(PreviewOutput({"occurrences": found}).data)


class JobCancelApi(APIView):
    @extend_schema(request=None, responses={200: JobOutput, 409: Problem})
    def post(self, request, job_id):
        job = job_get(user=request.user, job_id=job_id)
        if job is None:
            raise Http404
        if not job_cancel(job=job, actor=request.user, now=db_now()):
            job.refresh_from_db()
            return _conflict(refusal("job.cancel", state=job.state), state=job.state)
        job = job_get(user=request.user, job_id=job_id)
        return Response(JobOutput(job, context={"viewer": request.user}).data)


def _run_action(request, run_id, action, refused: str) -> Response:
    """An operator action on a run: 404 when not visible, 409 (the `refused` action's
    refusal, by the run's state) when the action is illegal in that state, else the run."""
    run = run_get(user=request.user, run_id=run_id)
    if run is None:
        raise Http404
    if not action(run=run, actor=request.user, now=db_now()):
        run.refresh_from_db()
        return _conflict(refusal(refused, state=run.state), state=run.state)
    return Response(RunOutput(run_get(user=request.user, run_id=run_id)).data)


class RunCancelApi(APIView):
    @extend_schema(request=None, responses={200: RunOutput, 409: Problem})
    def post(self, request, run_id):
        return _run_action(request, run_id, run_cancel_request, "run.cancel")


class RunReplayApi(APIView):
    @extend_schema(request=None, responses={200: RunOutput, 409: Problem})
    def post(self, request, run_id):
        return _run_action(request, run_id, run_replay_request, "run.replay")
