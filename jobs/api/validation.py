"""The job body: strict input serializers that name the field and the reason of every error."""

from __future__ import annotations

import datetime as dt
import functools
import json
import re
import threading

from django.conf import settings
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers
from rest_framework.fields import SkipField, empty

from .. import dependencies, schedules
from ..registry import registered_task_names, task_arguments_problem
from ..retry import DEFAULT_RETRY

QUEUE_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,100}$")
MAX_LABELS = 32
LABEL_KEY_MAX_CHARS = 63
LABEL_KEY_RE = re.compile(rf"^[A-Za-z0-9_./-]{{1,{LABEL_KEY_MAX_CHARS}}}$")
MAX_JSON_DEPTH = 32


def json_problem(value) -> str | None:
    """Why a JSON value cannot be stored (PostgreSQL refuses NUL characters; deep nesting
    exhausts the stack), or None. Iterative, so that it is safe on any input."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if depth > MAX_JSON_DEPTH:
            return f"Nested deeper than {MAX_JSON_DEPTH} levels."
        if isinstance(item, str) and "\x00" in item:
            return "Contains a NUL character (\\u0000)."
        if isinstance(item, dict):
            pending.extend((key, depth + 1) for key in item)
            pending.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list):
            pending.extend((child, depth + 1) for child in item)
    return None


class StrictSerializer(serializers.Serializer):
    """Refuses keys it does not know, so a typo is an error rather than a silent default.

    A field left out of the data takes its default without DRF's per-field validation:
    what that validation gives a left-out field never changes (`_left_out_values`), and
    most of a job body's fields are usually left out (a bulk creation validates a
    thousand bodies)."""

    _given = None  # the keys of the data being validated, while it is

    def to_internal_value(self, data):
        if not isinstance(data, dict):
            return super().to_internal_value(data)
        unknown = sorted(set(data) - set(self.fields))
        if unknown:
            raise serializers.ValidationError({key: ["Unknown field."] for key in unknown})
        if getattr(self.root, "partial", False):  # DRF skips the left-out fields itself
            return super().to_internal_value(data)
        self._given = data.keys()
        try:
            validated = super().to_internal_value(data)
        finally:
            self._given = None
        left_out = _left_out_values(self)
        if not left_out.keys() - data.keys():
            return validated
        ordered = {}  # in the fields' order, as DRF returns them
        for name in self.fields:
            if name in validated:
                ordered[name] = validated[name]
            elif name in left_out and name not in data:
                value = left_out[name]
                ordered[name] = type(value)() if isinstance(value, list | dict) else value
        for key, value in validated.items():  # none expected: every source is its name
            ordered.setdefault(key, value)
        return ordered

    @property
    def _writable_fields(self):
        left_out = _left_out_values(self) if self._given is not None else {}
        for field in self.fields.values():
            if field.read_only or (field.field_name in left_out and
                                   field.field_name not in self._given):  # fmt: skip
                continue
            yield field


def _left_out_values(serializer: serializers.Serializer) -> dict:
    """Field name -> the value DRF's validation gives the field when the data leaves it out,
    for the fields where that is a constant (a scalar, or an empty list or dict), worked
    out once per class: not a field that is required, has no default, a callable default
    (but list and dict), a `validate_<name>` method (which may read settings) or another
    source than its name."""
    cls = type(serializer)
    known = _left_out_cache.get(cls)
    if known is not None:
        return known
    known = {}
    for name, field in serializer.fields.items():
        if (field.read_only or field.source != name or field.default is empty
                or (callable(field.default) and field.default not in (list, dict))
                or hasattr(serializer, f"validate_{name}")):  # fmt: skip
            continue
        try:
            value = field.run_validation(empty)
        except (serializers.ValidationError, SkipField):
            continue
        if value is None or isinstance(value, str | int | float | bool) or value in ([], {}):
            known[name] = value
    _left_out_cache[cls] = known
    return known


_left_out_cache: dict[type, dict] = {}


class StrictIntegerField(serializers.IntegerField):
    """An integer given as a JSON number: "5", 5.5 and true are refused."""

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int | float):
            raise serializers.ValidationError("Must be an integer (a JSON number).")
        if isinstance(data, float) and not data.is_integer():
            raise serializers.ValidationError("Must be a whole number.")
        return super().to_internal_value(int(data))


class StrictFloatField(serializers.FloatField):
    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int | float):
            raise serializers.ValidationError("Must be a number.")
        return super().to_internal_value(data)


class StrictBooleanField(serializers.BooleanField):
    def to_internal_value(self, data):
        if not isinstance(data, bool):
            raise serializers.ValidationError("Must be true or false.")
        return data


@extend_schema_field(OpenApiTypes.DATETIME)
class AwareDateTimeField(serializers.Field):
    """An ISO 8601 instant with an explicit offset (Z or +hh:mm); stored as UTC text."""

    def to_internal_value(self, data):
        if not isinstance(data, str):
            raise serializers.ValidationError("Must be an ISO 8601 date-time string.")
        try:
            value = dt.datetime.fromisoformat(data.strip())
        except ValueError as exc:
            raise serializers.ValidationError(
                f"'{data}' is not an ISO 8601 date-time (e.g. 2026-01-31T09:00:00Z)."
            ) from exc
        if value.tzinfo is None:
            raise serializers.ValidationError(
                "Must include a UTC offset (e.g. Z or +01:00): a local time is ambiguous."
            )
        try:
            return value.astimezone(dt.UTC).isoformat()
        except OverflowError as exc:
            raise serializers.ValidationError(f"'{data}' is out of the supported range.") from exc

    def to_representation(self, value):
        return value


class ScheduleSerializer(StrictSerializer):
    kind = serializers.ChoiceField(choices=["once", "cron", "interval", "after"])
    run_at = AwareDateTimeField(required=False)
    expression = serializers.CharField(required=False, max_length=200)
    timezone = serializers.CharField(required=False, max_length=64)
    every_seconds = StrictIntegerField(required=False, min_value=1, max_value=366 * 86400)
    # kind `after` (jobs.dependencies): the upstream jobs, when their runs count, and how
    # long a fan-in waits for the rest once the first has arrived.
    jobs = serializers.ListField(
        child=serializers.UUIDField(format="hex_verbose"),
        required=False,
        min_length=1,
        max_length=dependencies.MAX_UPSTREAMS,
    )
    on = serializers.ChoiceField(choices=list(dependencies.ON_STATES), required=False)
    within_seconds = StrictIntegerField(required=False, min_value=1, max_value=366 * 86400)

    REQUIRED = {
        "once": ("run_at",),
        "cron": ("expression",),
        "interval": ("every_seconds",),
        "after": ("jobs",),
    }
    OPTIONAL = {"cron": ("timezone",), "after": ("on", "within_seconds")}

    def validate(self, attrs):
        kind = attrs["kind"]
        required = self.REQUIRED[kind]
        errors = {
            field: [f"Required for a '{kind}' schedule."]
            for field in required
            if field not in attrs
        }
        errors |= {
            field: [f"Not allowed for a '{kind}' schedule."]
            for field in attrs
            if field != "kind"
            and field not in required
            and field not in self.OPTIONAL.get(kind, ())
        }
        if errors:
            raise serializers.ValidationError(errors)
        if kind == "cron":
            attrs.setdefault("timezone", "UTC")
        if kind == "after":
            if len(set(attrs["jobs"])) != len(attrs["jobs"]):
                raise serializers.ValidationError({"jobs": ["Names a job more than once."]})
            attrs["jobs"] = [str(job_id) for job_id in attrs["jobs"]]
            attrs.setdefault("on", dependencies.DEFAULT_ON)
        return attrs

    # Field-level checks run before validate(), and every field's error is reported at once.
    def validate_expression(self, value):
        try:
            return schedules.normalize_cron(value)
        except schedules.ScheduleError as exc:
            raise serializers.ValidationError(str(exc)) from exc

    def validate_timezone(self, value):
        try:
            schedules.zone(value)
        except schedules.ScheduleError as exc:
            raise serializers.ValidationError(str(exc)) from exc
        return value


class RetrySerializer(StrictSerializer):
    max_attempts = StrictIntegerField(
        min_value=1, max_value=100, default=DEFAULT_RETRY["max_attempts"]
    )
    initial_delay_seconds = StrictFloatField(
        min_value=0, max_value=86400, default=DEFAULT_RETRY["initial_delay_seconds"]
    )
    backoff_factor = StrictFloatField(
        min_value=1, max_value=10, default=DEFAULT_RETRY["backoff_factor"]
    )
    max_delay_seconds = StrictFloatField(
        min_value=0, max_value=7 * 86400, default=DEFAULT_RETRY["max_delay_seconds"]
    )
    jitter = StrictBooleanField(default=DEFAULT_RETRY["jitter"])


class MisfireSerializer(StrictSerializer):
    policy = serializers.ChoiceField(choices=["run_all", "run_latest", "skip"], default="run_all")
    grace_seconds = StrictIntegerField(
        min_value=0, max_value=366 * 86400, default=None, allow_null=True
    )


class CalendarRefsSerializer(StrictSerializer):
    """The calendars a job names, by id: `exclude` (an occurrence any of them holds does not
    run) and `only` (an occurrence none of them holds does not run)."""

    exclude = serializers.ListField(child=serializers.UUIDField(), max_length=20, default=list)
    only = serializers.ListField(child=serializers.UUIDField(), max_length=20, default=list)

    def validate(self, attrs):
        return {role: list(dict.fromkeys(str(value) for value in attrs[role])) for role in attrs}


class DstSerializer(StrictSerializer):
    gap = serializers.ChoiceField(choices=list(schedules.GAP_POLICIES), default="shift")
    fold = serializers.ChoiceField(choices=list(schedules.FOLD_POLICIES), default="auto")


# Server-managed fields of a job: refused in a body with their own message.
READ_ONLY_JOB_FIELDS = ("id", "owner", "state", "version", "next_run_at", "created_at",
                        "updated_at", "deleted_at")  # fmt: skip


def refuse_read_only(data) -> None:
    if isinstance(data, dict):
        given = [key for key in READ_ONLY_JOB_FIELDS if key in data]
        if given:
            raise serializers.ValidationError(
                {key: ["Read-only: set by the server, not through the API."] for key in given}
            )


# What a job's first fire depends on, besides the instant it is created.
FIRST_FIRE_FIELDS = ("schedule", "dst", "start_at", "end_at")


# A one-time job's run_at may be at most this far in the past (it then runs at once, within
# its misfire policy) or in the future.
RUN_AT_PAST = dt.timedelta(days=1)
RUN_AT_FUTURE = dt.timedelta(days=3650)


class JobSpecSerializer(StrictSerializer):
    """Everything a user may set on a job. Server-managed fields are not here at all."""

    def to_internal_value(self, data):
        refuse_read_only(data)
        return super().to_internal_value(data)

    name = serializers.CharField(max_length=200)
    task = serializers.CharField(max_length=200)
    args = serializers.ListField(child=serializers.JSONField(), default=list)
    kwargs = serializers.DictField(child=serializers.JSONField(), default=dict)
    payload_ref = serializers.CharField(
        max_length=2000, required=False, allow_null=True, default=None
    )
    schedule = ScheduleSerializer()
    retry = RetrySerializer(default=dict)
    timeout_seconds = StrictIntegerField(min_value=1, max_value=7 * 86400, default=3600)
    heartbeat_timeout_seconds = StrictIntegerField(min_value=1, max_value=3600, default=60)
    overlap = serializers.ChoiceField(
        choices=["skip", "allow", "buffer_one", "cancel_previous"], default="allow"
    )
    misfire = MisfireSerializer(default=dict)
    dst = DstSerializer(default=dict)
    calendars = CalendarRefsSerializer(required=False)
    jitter_seconds = StrictIntegerField(min_value=0, max_value=86400, default=0)
    pause_after_failures = StrictIntegerField(
        min_value=1, max_value=1000, default=None, allow_null=True
    )
    delivery = serializers.ChoiceField(
        choices=["at_least_once", "at_most_once"], default="at_least_once"
    )
    priority = StrictIntegerField(min_value=0, max_value=9, default=0)
    queue = serializers.CharField(max_length=100, default=settings.SCHEDULER_DEFAULT_QUEUE)
    labels = serializers.DictField(child=serializers.CharField(max_length=200), default=dict)
    start_at = AwareDateTimeField(required=False, allow_null=True, default=None)
    end_at = AwareDateTimeField(required=False, allow_null=True, default=None)

    def validate_task(self, value):
        if value not in registered_task_names():
            raise serializers.ValidationError(
                f"'{value}' is not a registered task (register it with @job_task and list its "
                "module in SCHEDULER_TASK_MODULES)."
            )
        return value

    def validate_queue(self, value):
        if not QUEUE_RE.match(value):
            raise serializers.ValidationError("Letters, digits and _ . : - only (1-100).")
        if value not in settings.SCHEDULER_QUEUES:
            raise serializers.ValidationError(
                f"'{value}' is not a configured queue; the operator's SCHEDULER_QUEUES allows: "
                f"{', '.join(settings.SCHEDULER_QUEUES)}."
            )
        return value

    def validate_labels(self, value):
        if len(value) > MAX_LABELS:
            raise serializers.ValidationError(f"At most {MAX_LABELS} labels.")
        for key in value:
            if not LABEL_KEY_RE.match(key):
                raise serializers.ValidationError(
                    f"Label key {key[:80]!r}: 1-{LABEL_KEY_MAX_CHARS} letters, digits and "
                    "_ . / - only."
                )
        return value

    NESTED_DEFAULTS = {"retry": RetrySerializer, "misfire": MisfireSerializer, "dst": DstSerializer}

    def validate(self, attrs):
        # An omitted policy is stored whole, with its defaults, in the job's version.
        for field, serializer in self.NESTED_DEFAULTS.items():
            if not attrs[field]:
                # A copy: the cached defaults are shared by every body in the process (their
                # values are scalars: `_defaults_of`).
                attrs[field] = dict(_defaults_of(serializer))
        limit = settings.SCHEDULER_MAX_PAYLOAD_BYTES
        for field in ("args", "kwargs"):
            if not attrs[field]:  # [] or {}: nothing to look into, 2 bytes
                continue
            problem = json_problem(attrs[field])
            if problem:
                raise serializers.ValidationError({field: [problem]})
            size = len(json.dumps(attrs[field]).encode())
            if size > limit:
                raise serializers.ValidationError(
                    {
                        field: [
                            f"Too large: {size} bytes as JSON, the limit is {limit}; pass "
                            "large inputs by reference in payload_ref."
                        ]
                    }
                )
        size = len(json.dumps(attrs, default=str).encode())
        if size > settings.SCHEDULER_MAX_SPEC_BYTES:
            raise serializers.ValidationError(
                f"The job body is {size} bytes as JSON, the limit is "
                f"{settings.SCHEDULER_MAX_SPEC_BYTES}."
            )
        unchanged = self.context.get("unchanged", ())
        if not {"task", "args", "kwargs"} <= set(unchanged):
            self._check_arguments(attrs)
        if "schedule" not in unchanged:
            self._check_run_at(attrs["schedule"])
        if attrs["start_at"] and attrs["end_at"] and attrs["end_at"] <= attrs["start_at"]:
            raise serializers.ValidationError({"end_at": ["Must be later than start_at."]})
        schedule = attrs["schedule"]
        if schedule["kind"] == "after":
            # Its runs come from its upstreams' ends: no instant of its own to bound.
            errors = {
                field: ["Not allowed for an 'after' schedule: its runs follow its upstreams."]
                for field in ("start_at", "end_at", "jitter_seconds")
                if attrs.get(field)
            }
            if errors:
                raise serializers.ValidationError(errors)
            if "now" in self.context:
                self.context["first_fire"] = None
            return attrs
        if (
            schedule["kind"] == "once"
            and attrs["start_at"]
            and schedules.schedule_run_at(schedule) < dt.datetime.fromisoformat(attrs["start_at"])
        ):
            raise serializers.ValidationError(
                {"start_at": ["Later than the schedule's run_at: the job would never fire."]}
            )
        # Evaluate the schedule once now, so that one that cannot fire is refused here
        # rather than found by the scheduler.
        try:
            first = self._first_fire(attrs)
        except schedules.ScheduleError as exc:
            raise serializers.ValidationError({"schedule": [str(exc)]}) from exc
        if first is None:
            raise serializers.ValidationError(
                {"end_at": ["The schedule has no occurrence before end_at."]}
            )
        self._check_jitter(attrs, first)
        if "now" in self.context:  # the caller creates the job at that instant: reuse it
            self.context["first_fire"] = first
        return attrs

    @staticmethod
    def _check_arguments(attrs: dict) -> None:
        """The handler must accept the args and kwargs (its first parameter, the run's
        context, aside): a mismatch is refused now, not found as a TypeError at run time."""
        problem = task_arguments_problem(
            name=attrs["task"], args=attrs["args"], kwargs=attrs["kwargs"]
        )
        if problem:
            field = "kwargs" if attrs["kwargs"] and "keyword" in problem else "args"
            raise serializers.ValidationError({field: [problem]})

    def _check_run_at(self, schedule: dict) -> None:
        """A one-time job's run_at within RUN_AT_PAST .. RUN_AT_FUTURE of now
        (docs/api.md, "Job body"): 0001-01-01 or 9999-12-31 is a mistake, not a plan."""
        if schedule["kind"] != "once":
            return
        now = self.context.get("now") or timezone.now()
        run_at = schedules.schedule_run_at(schedule)
        if run_at < now - RUN_AT_PAST:
            raise serializers.ValidationError(
                {"schedule": {"run_at": [f"More than {RUN_AT_PAST.days} day in the past."]}}
            )
        if run_at > now + RUN_AT_FUTURE:
            raise serializers.ValidationError(
                {"schedule": {"run_at": [f"More than {RUN_AT_FUTURE.days // 365} years ahead."]}}
            )

    def _first_fire(self, attrs: dict) -> dt.datetime | None:
        """The schedule's first fire at the context's `now` (else the clock's); with a
        `now`, remembered per schedule in the context, since the many bodies of a bulk
        request often share one."""
        now = self.context.get("now")
        if now is None:
            return schedules.job_first_fire(spec=attrs, now=timezone.now())
        memo = self.context.setdefault("first_fires", {})
        key = json.dumps([now.isoformat(), *(attrs[f] for f in FIRST_FIRE_FIELDS)],
                         sort_keys=True)  # fmt: skip
        if key not in memo:
            memo[key] = schedules.job_first_fire(spec=attrs, now=now)
        return memo[key]

    @staticmethod
    def _check_jitter(attrs: dict, first: dt.datetime) -> None:
        """Refuse a jitter as long as the gap between two occurrences: each run would still
        wait for its jitter at the next occurrence, so skip, buffer_one and cancel_previous
        would hold back or cancel every run, and allow would pile them up."""
        jitter = attrs["jitter_seconds"]
        if not jitter or attrs["schedule"]["kind"] == "once":
            return
        try:
            gap = schedules.shortest_gap(
                attrs["schedule"],
                after=first - dt.timedelta(microseconds=1),
                dst=attrs["dst"],
                within=jitter,
            )
        except schedules.ScheduleError:  # ends after its first occurrence: nothing to overlap
            return
        if gap is not None:
            raise serializers.ValidationError(
                {
                    "jitter_seconds": [
                        f"Must be shorter than the schedule's period: occurrences "
                        f"{int(gap.total_seconds())} s apart would each still wait for "
                        "their jitter when the next one is due."
                    ]
                }
            )


_checkers = threading.local()


def job_spec_check(data, *, now: dt.datetime) -> tuple[dict, dt.datetime]:
    """A job body validated as `JobSpecSerializer(data=...).is_valid(raise_exception=True)`
    would (the same ValidationError), and its first fire at `now`, by one serializer per
    thread reused for every body: building a serializer deep-copies all its fields, which
    cost more than validating a body. ListSerializer reuses its child the same way."""
    checker = getattr(_checkers, "job_spec", None)
    if checker is None:
        checker = _checkers.job_spec = JobSpecSerializer(context={})
    if checker.context.get("now") != now:
        checker.context.clear()  # the remembered first fires were for another instant
        checker.context["now"] = now
    if data is None:  # a JSON null: is_valid's own wording
        raise serializers.ValidationError({"non_field_errors": ["No data provided"]})
    try:
        spec = dict(checker.run_validation(data))
    except serializers.ValidationError as exc:
        raise serializers.ValidationError(serializers.as_serializer_error(exc)) from exc
    return spec, checker.context.pop("first_fire")


@functools.cache
def _defaults_of(serializer_class) -> dict:
    """A nested policy's defaults, validated once (its fields are constants), not once per
    body: a serializer's construction copies all its fields. Scalars only, so that a
    shallow copy of them is a copy (JobSpecSerializer.validate)."""
    defaults = dict(serializer_class().run_validation({}))
    assert all(isinstance(v, str | int | float | bool | None) for v in defaults.values())
    return defaults


def job_patched_spec(*, spec: dict, patch) -> dict:
    """A job's spec with `patch` applied and the result validated whole, by the rules of
    creation. A top-level field given replaces the stored one entirely (a nested object
    such as `schedule` or `retry` is given whole; omitted nested fields take their
    defaults). ValidationError names each bad field."""
    if not isinstance(patch, dict):
        raise serializers.ValidationError({"non_field_errors": ["Must be a JSON object."]})
    refuse_read_only(patch)
    unknown = sorted(set(patch) - set(JobSpecSerializer().fields))
    if unknown:
        raise serializers.ValidationError({key: ["Unknown field."] for key in unknown})
    # A field the patch leaves alone is not re-judged against today's clock or handler.
    unchanged = set(spec) - set(patch)
    merged = JobSpecSerializer(data={**spec, **patch}, context={"unchanged": unchanged})
    merged.is_valid(raise_exception=True)
    return dict(merged.validated_data)


class PreviewSerializer(StrictSerializer):
    schedule = ScheduleSerializer()
    dst = DstSerializer(default=dict)
    calendars = CalendarRefsSerializer(required=False)
    after = AwareDateTimeField(
        required=False, help_text="Fire instants strictly after this one; default now."
    )
    count = StrictIntegerField(min_value=1, max_value=100, default=10)

    def validate(self, attrs):
        if not attrs["dst"]:
            attrs["dst"] = dict(DstSerializer().run_validation({}))
        return attrs


class BackfillSerializer(StrictSerializer):
    start = AwareDateTimeField(help_text="Inclusive.")
    end = AwareDateTimeField(help_text="Exclusive; not later than now.")

    def validate(self, attrs):
        start = dt.datetime.fromisoformat(attrs["start"])
        end = dt.datetime.fromisoformat(attrs["end"])
        if end <= start:
            raise serializers.ValidationError({"end": ["Must be later than start."]})
        if end > self.context["now"]:
            raise serializers.ValidationError(
                {"end": ["Must not be in the future: the scheduler runs future occurrences."]}
            )
        return {"start": start, "end": end}


def backfill_instants(*, job, start: dt.datetime, end: dt.datetime) -> list[dt.datetime]:
    """The job's occurrences in a validated backfill window (BackfillSerializer's), or the
    ValidationError naming the field when the range is too large for one request or the
    schedule cannot be evaluated from its start."""
    try:
        return schedules.backfill_occurrences(job=job, start=start, end=end)
    except schedules.BackfillTooLarge as exc:
        raise serializers.ValidationError({"end": [f"{exc}; backfill a shorter range."]}) from exc
    except schedules.ScheduleError as exc:
        raise serializers.ValidationError(
            {"start": [f"The job's schedule cannot be evaluated from this start: {exc}."]}
        ) from exc


def dependencies_check(*, spec: dict, visible, job_id=None) -> None:
    """Refuse (ValidationError on `schedule.jobs`) an `after` schedule naming a job the
    caller cannot see (`visible`: the queryset of those it can, or a function returning it,
    called only for a spec that names upstreams: deciding what a user sees costs a
    statement; a job that does not exist is refused in the same words, so the answer tells
    nothing about others' jobs), or one that would close a cycle through `job_id` (the job
    being edited). The service checks cycles again under the graph's lock
    (jobs.dependencies.dependency_edges_write)."""
    upstreams = dependencies.dependency_upstream_ids(spec)
    if not upstreams:
        return
    if callable(visible):
        visible = visible()
    seen = set(visible.filter(id__in=upstreams).values_list("id", flat=True))
    unseen = [str(upstream) for upstream in upstreams if upstream not in seen]
    if unseen:
        raise serializers.ValidationError(
            {"schedule": {"jobs": [f"Not a job you can see: {', '.join(unseen)}."]}}
        )
    if job_id is not None and dependencies.dependency_reaches(start=upstreams, target=job_id):
        raise serializers.ValidationError(
            {"schedule": {"jobs": ["Would make a cycle: this job is upstream of one it names."]}}
        )
