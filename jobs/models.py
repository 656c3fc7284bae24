"""Every stored record of a job's lifecycle: jobs, their versions, runs, attempts, the
outbox, the effect ledger, durable counters, idempotency records and the audit trail.

State changes never happen here: `jobs.transitions` owns every one of them.
"""

import uuid

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.core.validators import MinValueValidator
from django.db import models
from django.db.models import F, Q
from django.db.models.functions import Now
from django.utils import timezone


class JobState(models.TextChoices):
    """A job's lifecycle; each comment names what moves a job out of the state (every move
    is a function of `jobs.transitions`). `active` jobs with a next fire are found through
    `job_due_idx`."""

    ACTIVE = "active"  # pause, cancel (services); the completer once its schedule is over
    PAUSED = "paused"  # resume, cancel (services)
    CANCELLED = "cancelled"  # terminal
    COMPLETED = "completed"  # terminal: the schedule is over and no run is active


class RunState(models.TextChoices):
    """A run's lifecycle; each comment names the component that moves a run out of it."""

    PENDING = "pending"  # held back (jitter, buffer_one); dispatch.promoter queues it
    QUEUED = "queued"  # outbox committed; the worker's claim (dispatch.worker) runs it
    RUNNING = "running"  # an attempt holds the lease; its outcome (worker, reaper) moves it
    RETRY_WAIT = "retry_wait"  # dispatch.promoter re-queues it at next_attempt_at
    SUCCEEDED = "succeeded"  # terminal
    FAILED = "failed"  # terminal (dead letter); an operator replay may re-queue it
    CANCELLED = "cancelled"  # terminal; an operator replay may re-queue it
    SKIPPED = "skipped"  # terminal: overlap or misfire policy, kept to be visible


class RunKind(models.TextChoices):
    SCHEDULED = "scheduled"
    MANUAL = "manual"
    BACKFILL = "backfill"


class FailureReason(models.TextChoices):
    """Why a run ended `failed`; `jobs.retry.retry_decision` chooses it."""

    ERROR = "error"  # the handler raised NonRetryableError
    TIMEOUT = "timeout"  # the last attempt ran past timeout_seconds
    LOST = "lost"  # the last attempt's worker vanished (lease expired)
    EXHAUSTED = "exhausted"  # every attempt of the retry budget failed
    OUTCOME_UNKNOWN = "outcome_unknown"  # at_most_once: an attempt was lost after it started
    UNDELIVERABLE = "undeliverable"  # re-published again and again, never claimed by a worker


class AttemptState(models.TextChoices):
    """An attempt's lifecycle, and the one vocabulary for how an attempt ended."""

    RUNNING = "running"  # its worker's outcome, the reaper, or a cancel moves it on
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # the handler raised
    TIMED_OUT = "timed_out"  # past timeout_seconds (Celery's soft limit, or the reaper)
    LOST = "lost"  # its lease expired (the reaper)
    CANCELLED = "cancelled"  # the run was cancelled while it ran


# A job labelled `managed-by` (any value) has a name unique among its owner's live jobs.
MANAGED_LABEL = "managed-by"
MANAGED_NAME_CONSTRAINT = "job_managed_name_uniq"


class Job(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="jobs"
    )
    name = models.CharField(max_length=200)
    task = models.CharField(max_length=200)
    state = models.CharField(max_length=16, choices=JobState.choices, default=JobState.ACTIVE)
    version = models.PositiveIntegerField(default=1)
    # The job's whole user-given spec (schedule, args, policies); JobVersion keeps each one.
    spec = models.JSONField()
    queue = models.CharField(max_length=100)
    priority = models.PositiveSmallIntegerField(default=0)
    labels = models.JSONField(default=dict, blank=True)
    # The next occurrence, materialized so that due work is found through job_due_idx.
    next_run_at = models.DateTimeField(null=True, blank=True)
    # Interval schedules count from here (or start_at): set by job_create, never auto.
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)
    # Set by the last resume: pause_after_failures counts only runs finished after it.
    resumed_at = models.DateTimeField(null=True, blank=True)
    # Soft delete: hidden from every read, kept with its versions, runs and audit trail.
    deleted_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            # Only jobs with a next fire: a job whose schedule is over (next_run_at NULL,
            # awaiting completion) is found by its primary key, never by a walk of this.
            models.Index(
                fields=["next_run_at"],
                name="job_due_idx",
                condition=Q(state="active", next_run_at__isnull=False),
            ),
            models.Index(fields=["owner", "created_at"], name="job_owner_idx"),
            # Jobs whose schedule is over and that are not completed yet: the completer's
            # safety net reads these only (dispatch.completer).
            # A job of kind `after` has no next_run_at and is never over: not in it.
            models.Index(
                fields=["id"],
                name="job_awaiting_completion_idx",
                condition=Q(state="active", next_run_at=None, deleted_at=None)
                & ~Q(spec__schedule__kind="after"),
            ),
        ]
        # The admin's actions (jobs/admin_actions.py) each need one of these.
        permissions = [
            ("pause_job", "Can pause and resume jobs"),
            ("cancel_job", "Can cancel jobs"),
            ("trigger_job", "Can trigger and backfill jobs"),
        ]
        constraints = [
            models.CheckConstraint(condition=Q(state__in=JobState.values), name="job_state_valid"),
            # Jobs kept as code (`schedctl apply`, or any tool that labels its jobs
            # `managed-by`): one live job per owner and name, so the name is their key and
            # two concurrent applies of one file cannot both create it (docs/api.md).
            models.UniqueConstraint(
                fields=["owner", "name"],
                condition=Q(
                    state__in=["active", "paused"],
                    deleted_at=None,
                    labels__has_key=MANAGED_LABEL,
                ),
                name=MANAGED_NAME_CONSTRAINT,
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.id})"


class JobVersion(models.Model):
    """Immutable snapshot of a job's spec; a run records the version that created it."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="versions")
    version = models.PositiveIntegerField()
    spec = models.JSONField()
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["job", "version"], name="job_version_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.job_id} v{self.version}"


class Run(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    # No index of its own: run_job_idx (job_id, scheduled_for) serves every lookup by job.
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="runs", db_index=False)
    # No index either: no query looks runs up by version (they join a run to its version,
    # through the version's key), and a version is never deleted (a job's delete is soft),
    # so nothing pays for an index that every version of every run would write.
    job_version = models.ForeignKey(
        JobVersion, on_delete=models.PROTECT, related_name="runs", db_index=False
    )
    kind = models.CharField(max_length=16, choices=RunKind.choices, default=RunKind.SCHEDULED)
    state = models.CharField(max_length=16, choices=RunState.choices)
    scheduled_for = models.DateTimeField()
    # Stable across every attempt: what handlers give external systems to deduplicate.
    # Unique by a constraint (jobs_run_idempotency_key_key): the field's `unique=True`
    # would add a LIKE index (varchar_pattern_ops) beside it that no query uses and every
    # version of a run writes.
    idempotency_key = models.CharField(max_length=200)
    # The last fencing token issued; an attempt is current only while it holds this one.
    fencing_token = models.PositiveIntegerField(default=0)
    attempt_count = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    failure_reason = models.CharField(
        max_length=32, choices=FailureReason.choices, blank=True, default=""
    )
    # Why a run was skipped (misfire or overlap policy); empty for every other state.
    skip_reason = models.CharField(max_length=200, blank=True, default="")
    result = models.JSONField(null=True, blank=True)
    # Per-stage timestamps: due -> created -> published -> started -> finished.
    due_at = models.DateTimeField()
    created_at = models.DateTimeField()
    published_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # The database's clock, never a process's (reconciliation compares it with the database's
    # now): the default on insert, and every transition sets it (jobs.transitions).
    updated_at = models.DateTimeField(db_default=Now())
    duplicate_deliveries = models.PositiveIntegerField(default=0)
    # Attempts made before the latest operator replay: a replay grants a fresh retry budget.
    retry_base = models.PositiveIntegerField(default=0)
    # The latest operator replay, if any: a replayed run travels in its queue's replay lane
    # (jobs.lanes), so a bulk replay never sits ahead of the queue's next scheduled runs.
    replayed_at = models.DateTimeField(null=True, blank=True)
    # Times reconciliation re-published this run because its message never reached a worker.
    republish_count = models.PositiveIntegerField(default=0)
    # Reconciliation's mark on a queued run whose message waits in the outbox on purpose
    # (backpressure, a paused queue, an owner's limit): the `updated_at` it had when
    # marked. Any later stamp of `updated_at` (its late publication, a republication, any
    # transition) voids the mark, so it never hides a published run (dispatch.reconciler).
    held_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["job", "-scheduled_for"], name="run_job_idx"),
            models.Index(fields=["state", "-created_at"], name="run_state_idx"),
            models.Index(
                fields=["next_attempt_at"],
                name="run_retry_due_idx",
                condition=Q(state="retry_wait"),
            ),
            # Reconciliation looks for runs queued for long without a worker's claim, past
            # the runs it marked as held back in the outbox (their mark still valid).
            models.Index(
                fields=["updated_at", "id"],
                name="run_queued_unheld_idx",
                condition=Q(state="queued") & ~Q(held_at=F("updated_at")),
            ),
            # The scheduler releases pending runs (jitter, buffer_one) once due.
            models.Index(fields=["due_at"], name="run_pending_idx", condition=Q(state="pending")),
            # A job's active runs (overlap policy, the completer) and its latest finished
            # ones (pause_after_failures), read without its history.
            models.Index(
                fields=["job", "created_at"],
                name="run_job_active_idx",
                condition=Q(state__in=["pending", "queued", "retry_wait", "running"]),
            ),
            models.Index(
                fields=["job", "finished_at", "id"],
                name="run_job_finished_idx",
                condition=Q(state__in=["failed", "succeeded"]),
            ),
            # The pruner takes the oldest finished runs (jobs.retention), never reading the
            # active ones.
            models.Index(
                fields=["finished_at"],
                name="run_finished_idx",
                condition=Q(state__in=["cancelled", "failed", "skipped", "succeeded"]),
            ),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["idempotency_key"], name="jobs_run_idempotency_key_key"
            ),
            # One scheduled run per occurrence, however many scheduler replicas run.
            models.UniqueConstraint(
                fields=["job", "scheduled_for"],
                name="run_one_per_occurrence",
                condition=Q(kind="scheduled"),
            ),
            # Repeating a backfill over the same range creates nothing new.
            models.UniqueConstraint(
                fields=["job", "scheduled_for"],
                name="run_one_backfill_per_occurrence",
                condition=Q(kind="backfill"),
            ),
            models.CheckConstraint(condition=Q(state__in=RunState.values), name="run_state_valid"),
        ]
        permissions = [("cancel_run", "Can cancel runs"), ("replay_run", "Can replay runs")]

    def __str__(self) -> str:
        return f"run {self.id} of {self.job_id} at {self.scheduled_for:%Y-%m-%d %H:%M:%S}"


class BackfilledOccurrences(models.Model):
    """Occurrences of a job that a backfill has run, kept after retention deletes their
    runs so that no backfill runs one twice (jobs.services.job_backfill; docs/semantics.md,
    "Backfill"): the instants `first`, `first + step`, ... up to `last` inclusive (one
    instant: `step` zero). A backfill of a regular schedule is one row (an hour's cron
    over a year: one row, or one per DST change), however many runs it made."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="+", db_index=False)
    first = models.DateTimeField()
    last = models.DateTimeField()
    step = models.DurationField()

    class Meta:
        indexes = [models.Index(fields=["job", "last"], name="backfilled_job_last_idx")]
        constraints = [
            models.CheckConstraint(
                condition=Q(first__lte=F("last")), name="backfilled_first_not_after_last"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.job_id}: {self.first:%Y-%m-%d %H:%M:%S} .. {self.last:%Y-%m-%d %H:%M:%S}"


class Attempt(models.Model):
    # No index of its own: attempt_number_unique (run_id, number) serves every lookup by run.
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="attempts", db_index=False)
    number = models.PositiveIntegerField()
    fencing_token = models.PositiveIntegerField()
    state = models.CharField(max_length=16, choices=AttemptState.choices)
    worker = models.CharField(max_length=200, blank=True, default="")
    # Unique per claim call: a worker whose claim's commit was ambiguous (the connection
    # dropped during COMMIT) recognizes its own attempt when it asks again.
    claim_id = models.UUIDField(null=True, blank=True)
    # The id of the Celery task that delivered it (its outbox row's message_id): the key of
    # its result in django-celery-results when SCHEDULER_CELERY_RESULTS is on.
    task_id = models.CharField(max_length=64, blank=True, default="")
    lease_expires_at = models.DateTimeField()
    # started_at + timeout_seconds: the worker stops the handler then; the reaper after.
    deadline_at = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField()
    # None while the attempt is reserved with its pack (dispatch.worker) and its handler
    # has not been seen to start; the worker records the start with the outcome.
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    error = models.TextField(blank=True, default="")
    # Given back unstarted (a pack's reserved attempt its worker never reached, or released
    # by the reaper: `jobs.transitions.attempt_release`): ended `lost` without counting
    # against its run's retry budget, nor in scheduler_attempts_total (storage.tallies).
    released = models.BooleanField(default=False, db_default=False)

    class Meta:
        ordering = ["run", "number"]
        constraints = [
            models.UniqueConstraint(fields=["run", "number"], name="attempt_number_unique"),
            models.UniqueConstraint(fields=["run", "fencing_token"], name="attempt_token_unique"),
            # One running attempt per run.
            models.UniqueConstraint(
                fields=["run"], name="attempt_one_running", condition=Q(state="running")
            ),
            models.CheckConstraint(
                condition=Q(state__in=AttemptState.values), name="attempt_state_valid"
            ),
        ]
        indexes = [
            models.Index(
                fields=["lease_expires_at"],
                name="attempt_lease_idx",
                condition=Q(state="running"),
            ),
        ]

    def __str__(self) -> str:
        return f"attempt {self.number} of run {self.run_id}"


class AuditEvent(models.Model):
    """Who changed what, and when. Written in the transaction of the change it records."""

    created_at = models.DateTimeField(auto_now_add=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # "user:<name>" for people, "system:<component>" for processes.
    actor_label = models.CharField(max_length=200)
    action = models.CharField(max_length=64)
    job = models.ForeignKey(Job, null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    run = models.ForeignKey(Run, null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(fields=["job", "-created_at"], name="audit_job_idx"),
            models.Index(fields=["run", "-created_at"], name="audit_run_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.actor_label} {self.action}"


class IdempotencyRecord(models.Model):
    """The first successful answer to a request sent with an `Idempotency-Key` header.

    A repeat of the same key and body, by the same owner on the same operation, gets this
    answer again; another body gets 409. Kept for `IDEMPOTENCY_RETENTION`
    (jobs.idempotency), then pruned.
    """

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    # The operation: "jobs.create", "jobs.<id>.trigger", "jobs.<id>.backfill".
    scope = models.CharField(max_length=100)
    key = models.CharField(max_length=200)
    request_hash = models.CharField(max_length=64)
    response_status = models.PositiveSmallIntegerField()
    response_body = models.JSONField()
    created_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["owner", "scope", "key"], name="idempotency_key_unique"
            ),
        ]
        indexes = [models.Index(fields=["created_at"], name="idempotency_age_idx")]

    def __str__(self) -> str:
        return f"{self.scope} {self.key}"


# -- the outbox, the effect ledger and durable counters ----------------------------------


class OutboxState(models.TextChoices):
    # Written with the state change; the relay deletes the row once the broker confirmed
    # it, so a row is pending for as long as it exists (the worker's claim stamps the run's
    # `published_at`, sent in the message).
    PENDING = "pending"


class OutboxMessage(models.Model):
    """A task message to publish, committed in the transaction that made it necessary, and
    deleted by the relay in the transaction that saw the broker confirm it."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="outbox_messages")
    # The run's job's owner: the relay shares a queue's publishing among owners and holds
    # back an owner at its limit of active runs (docs/semantics.md, "fair shares").
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+", db_index=False
    )
    # The Celery task id: the same on every re-publication of this row. Random (the
    # writers' gen_random_uuid()) and never looked up: no unique index, which every row's
    # insert and claim would write.
    message_id = models.UUIDField(default=uuid.uuid4)
    task_name = models.CharField(max_length=200)
    queue = models.CharField(max_length=100)
    priority = models.PositiveSmallIntegerField(default=0)
    # The job's timeout_seconds: sent as Celery's soft time limit (the hard one a little
    # later), so the worker stops a handler that overruns.
    timeout_seconds = models.PositiveIntegerField(null=True, blank=True)
    state = models.CharField(
        max_length=16, choices=OutboxState.choices, default=OutboxState.PENDING
    )
    created_at = models.DateTimeField()
    publish_tries = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True, default="")
    # Since when every try was refused in a way that lasts until an operator acts (a queue
    # of other arguments, no permission): empty after any other failure. The relay fails
    # the run `undeliverable` once this is older than its grace (dispatch.relay).
    refused_since = models.DateTimeField(null=True, blank=True)
    # The relay's claim: which relay step is publishing the row, and until when (the
    # database's clock). A claim is taken and given up in short transactions, never held
    # across the broker's round trip; a claim whose lease ran out (its relay frozen or
    # dead) is any relay's to take again (dispatch.relay).
    claimed_by = models.UUIDField(null=True, blank=True)
    claimed_until = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "dispatch_outboxmessage"  # moved from the dispatch app; the table stays
        indexes = [
            # The relay claims by state, never by `id > last_seen` (rows commit out of order),
            # each queue on its own (backpressure: a full queue's rows wait, the others go),
            # owner by owner (fair shares, limits), by priority, then oldest first; it finds
            # the queues, and a queue's owners, with pending rows by skipping through the
            # index, one probe each.
            models.Index(
                fields=["queue", "owner", "-priority", "id"],
                name="outbox_pending_idx",
                condition=Q(state="pending"),
            ),
            # The oldest pending rows, for the stuck-outbox alarm and the metrics' oldest
            # pending age, without reading the backlog backpressure keeps on purpose.
            models.Index(
                fields=["created_at"], name="outbox_pending_age_idx", condition=Q(state="pending")
            ),
            # The rows a relay failed to publish (rare): reconciliation's alarm finds them
            # however many rows are held back on purpose before them.
            models.Index(
                fields=["created_at"],
                name="outbox_failing_idx",
                condition=Q(state="pending", publish_tries__gt=0),
            ),
            # The rows relays are publishing right now (a batch each at most): an owner's
            # count against its limit reads them, never its held-back backlog.
            models.Index(
                fields=["owner"],
                name="outbox_claimed_idx",
                condition=Q(state="pending", claimed_by__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"outbox {self.id} ({self.state})"


class OwnerLimit(models.Model):
    """An operator's limit for one owner: at most `max_active_runs` of the owner's runs in
    the broker or running at once, instead of SCHEDULER_OWNER_MAX_ACTIVE_RUNS; empty: no
    limit for this owner. Set in the admin, by operators only."""

    owner = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, primary_key=True,
        related_name="run_limit",
    )  # fmt: skip
    max_active_runs = models.PositiveIntegerField(
        null=True,
        blank=True,
        # 0 would hold the owner's runs back forever with nothing to show why: at least 1.
        validators=[MinValueValidator(1)],
        help_text="Runs of this owner in the broker or running at once (at least 1); "
        "empty: unlimited.",
    )
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"limit of {self.owner_id}: {self.max_active_runs}"


class QueueControl(models.Model):
    """An operator's control of one configured queue (and its lanes, jobs.lanes): paused or
    not, at most `max_running` of its runs running at once and at most `rate_per_second`
    publications a second, across the whole fleet. A queue without a row is free. The
    rate's token bucket lives here (`tokens` at `tokens_at`), taken by every relay in one
    conditional UPDATE (storage.queues): the one store every relay and worker already
    shares, so the limit needs no new component and survives any process."""

    name = models.CharField(max_length=100, primary_key=True)
    paused = models.BooleanField(default=False)
    paused_reason = models.CharField(max_length=500, blank=True, default="")
    # The pause ends by itself at this instant (None: until resumed).
    paused_until = models.DateTimeField(null=True, blank=True)
    paused_at = models.DateTimeField(null=True, blank=True)
    paused_by = models.CharField(max_length=200, blank=True, default="")
    max_running = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)]
    )
    # As given ("100/s", "6000/min"); "" none. rate_per_second is what the bucket uses.
    rate_limit = models.CharField(max_length=40, blank=True, default="")
    rate_per_second = models.FloatField(null=True, blank=True)
    burst = models.FloatField(null=True, blank=True)
    tokens = models.FloatField(default=0)
    tokens_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"queue {self.name}{' (paused)' if self.paused else ''}"


class BulkOperation(models.Model):
    """An action on every run or job that matched a filter when it was asked for
    (`POST /api/v1/runs/bulk/<action>/`, `/jobs/bulk/<action>/`): its targets are written
    as items at creation (the filter frozen: rows that arrive later are not among them)
    and done in bounded batches by the relays (jobs.operations), each through the single
    action's service with the owner as the actor; `running` until no item is left."""

    class State(models.TextChoices):
        RUNNING = "running"  # the relays' operations step works its items
        DONE = "done"  # terminal: every item done or refused

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    action = models.CharField(max_length=40)  # runs.cancel, runs.replay, jobs.pause, ...
    filter = models.JSONField(default=dict)
    state = models.CharField(max_length=20, choices=State.choices, default=State.RUNNING)
    matched = models.PositiveIntegerField(default=0)
    done = models.PositiveIntegerField(default=0)
    refused = models.JSONField(default=dict)  # reason -> count
    created_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["created_at"], name="bulk_operation_running_idx",
                         condition=Q(state="running")),
        ]  # fmt: skip

    def __str__(self) -> str:
        return f"{self.action} ({self.state}, {self.done}/{self.matched})"


class BulkOperationItem(models.Model):
    """One target of a bulk operation (a run's or a job's id); `outcome` empty while to do,
    then "done" or the reason it was refused, written in the transaction of its action."""

    operation = models.ForeignKey(BulkOperation, on_delete=models.CASCADE, related_name="items")
    target = models.UUIDField()
    outcome = models.CharField(max_length=100, blank=True, default="")

    class Meta:
        indexes = [
            models.Index(fields=["operation", "id"], name="bulk_item_todo_idx",
                         condition=Q(outcome="")),
        ]  # fmt: skip

    def __str__(self) -> str:
        return f"{self.target} ({self.outcome or 'to do'})"


# The states in which a run's ActiveRun row counts against its owner's limit.
OWNER_LIMIT_STATES = (RunState.QUEUED, RunState.RUNNING)


class ActiveRun(models.Model):
    """A run of a limited owner that the relay published: it counts against the owner's
    limit while the run is `queued` or `running`. The relay writes it with the publication
    and deletes those of finished runs before it counts an owner's (no trigger, nothing on
    the worker's path); a run given a new outbox row loses its row then
    (jobs.outbox.outbox_enqueue_runs)."""

    run = models.OneToOneField(Run, on_delete=models.CASCADE, primary_key=True, related_name="+")
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    published_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"active run {self.run_id} of {self.owner_id}"


class Effect(models.Model):
    """One recorded effect of a run: `with ctx.effect(name)` commits it at most once."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="effects")
    name = models.CharField(max_length=200)
    attempt_number = models.PositiveIntegerField()
    fencing_token = models.PositiveIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "dispatch_effect"
        constraints = [
            models.UniqueConstraint(fields=["run", "name"], name="effect_once_per_run"),
        ]

    def __str__(self) -> str:
        return f"effect {self.name} of run {self.run_id}"


class Counter(models.Model):
    """A monotonic counter shared by every process, exported on /metrics."""

    name = models.CharField(max_length=200)
    labels = models.CharField(max_length=400, blank=True, default="")
    value = models.BigIntegerField(default=0)

    class Meta:
        db_table = "dispatch_counter"
        constraints = [
            models.UniqueConstraint(fields=["name", "labels"], name="counter_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.name}{{{self.labels}}} {self.value}"


class ApiToken(models.Model):
    """An API key (`Authorization: Token <key>`), stored as the SHA-256 of the key: neither
    the admin nor a database dump shows a usable key (jobs.tokens). A user may hold several;
    each can expire and be revoked."""

    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens"
    )
    name = models.CharField(max_length=100, blank=True, default="")
    # The key's first characters, in clear: enough to tell tokens apart, not to use one.
    prefix = models.CharField(max_length=8)
    digest = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "jobs_api_token"
        indexes = [models.Index(fields=["owner", "created_at"], name="api_token_owner_idx")]

    def __str__(self) -> str:
        return f"{self.prefix}... of {self.owner_id}"


class ThrottleWindow(models.Model):
    """Requests counted in the current window of one (scope, user) (jobs.throttling): a
    row in the database every web process shares, so N processes allow the rate, not N
    times it. The pruner deletes it once its window has ended (storage.throttle)."""

    throttle_key = models.CharField(max_length=200, primary_key=True)
    window_ends_at = models.DateTimeField()  # on the database's clock
    hits = models.PositiveIntegerField()

    class Meta:
        db_table = "jobs_throttle_window"
        indexes = [models.Index(fields=["window_ends_at"], name="throttle_window_ends_idx")]

    def __str__(self) -> str:
        return f"{self.throttle_key}: {self.hits} in the window ending {self.window_ends_at}"


class Tally(models.Model):
    """The rolled-up figure of one series of a metric that PostgreSQL's triggers keep as
    the events commit (storage.tallies; docs/operations.md, "Metrics"): a histogram bucket
    (`labels` `le="0.5"`: observations in that bucket alone, with their sum) or a counter
    (`outcome="failed"`). The triggers never write it: they append `TallyDelta` rows, which
    the pruner adds in here (`shard` 0, the only one written); /metrics reads both."""

    name = models.CharField(max_length=200)
    labels = models.CharField(max_length=400, blank=True, default="")
    shard = models.SmallIntegerField(default=0)
    count = models.BigIntegerField(default=0)
    total = models.FloatField(default=0.0)

    class Meta:
        db_table = "jobs_tally"
        constraints = [
            models.UniqueConstraint(fields=["name", "labels", "shard"], name="tally_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.name}{{{self.labels}}} #{self.shard} {self.count}"


class TallyDelta(models.Model):
    """What one statement added to a tally's series, appended by the triggers
    (storage.tallies) in the statement's own transaction: an INSERT, never an UPDATE of a
    shared row, so no two transactions ever wait on each other for a tally. The pruner
    rolls them up into `Tally` and deletes them (`storage.tallies.tallies_roll_up`)."""

    name = models.CharField(max_length=200)
    labels = models.CharField(max_length=400, blank=True, default="")
    count = models.BigIntegerField(default=0)
    total = models.FloatField(default=0.0)

    class Meta:
        db_table = "jobs_tally_delta"

    def __str__(self) -> str:
        return f"{self.name}{{{self.labels}}} {self.count:+d}"


# -- partitions of due work between scheduler replicas (dispatch.partitions) -------------


class PartitionLease(models.Model):
    """A scheduler replica's lease on one partition of the jobs (jobs.partitions): while
    `expires_at` is ahead on the database's clock, only `holder` claims the partition's due
    work. Acquired with INSERT ... ON CONFLICT DO NOTHING, taken over once expired, renewed
    only while held, handed over or deleted by its holder (dispatch.partitions)."""

    partition = models.PositiveIntegerField(primary_key=True)
    holder = models.CharField(max_length=200)
    expires_at = models.DateTimeField()
    # When this holder got it (acquired, taken over or handed over): how long it stayed put.
    acquired_at = models.DateTimeField()

    class Meta:
        db_table = "jobs_partition_lease"

    def __str__(self) -> str:
        return f"partition {self.partition}: {self.holder} until {self.expires_at}"


class SchedulerReplica(models.Model):
    """A scheduler replica that shares the partitions: renewed with its leases, so that
    every replica counts the live ones (`expires_at` ahead) and takes its fair share, and a
    replica holding none yet is seen by those that must hand over to it."""

    holder = models.CharField(max_length=200, primary_key=True)
    expires_at = models.DateTimeField()
    joined_at = models.DateTimeField()
    # Its scheduler loop's database session (pg_backend_pid, and its backend_start, so a
    # recycled pid is never taken for it): ended by the replica that takes its expired
    # leases over, so the job rows a frozen pass keeps locked go with the partitions.
    session_pid = models.IntegerField(null=True, blank=True)
    session_started_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "jobs_scheduler_replica"

    def __str__(self) -> str:
        return f"{self.holder} until {self.expires_at}"


class ProcessClock(models.Model):
    """The skew of one process's clock against the database's (its clock minus the
    database's), measured by the process itself every few seconds (dispatch.clockskew) and
    exported as `scheduler_clock_skew_seconds`; a row not measured again within
    `jobs.clock.CLOCK_SKEW_EXPIRY` is a process gone, no longer exported, then deleted."""

    host = models.CharField(max_length=200)
    pid = models.PositiveIntegerField()
    kind = models.CharField(max_length=16)  # scheduler, relay, worker
    name = models.CharField(max_length=200, blank=True, default="")
    skew_seconds = models.FloatField()
    measured_at = models.DateTimeField()  # the database's clock

    class Meta:
        db_table = "jobs_process_clock"
        constraints = [
            models.UniqueConstraint(fields=["host", "pid", "kind"], name="process_clock_unique"),
        ]
        indexes = [models.Index(fields=["measured_at"], name="process_clock_age_idx")]

    def __str__(self) -> str:
        return f"{self.kind} {self.host}:{self.pid} {self.skew_seconds:+.3f}s"


class Calendar(models.Model):
    """When jobs that name it must not run (`exclude`), or the only days they may (`only`):
    dates, local ranges, RRULEs and public holidays, read in its own zone (jobs.calendars).
    Versioned as jobs are: `spec` is the current one, CalendarVersion keeps each."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="calendars"
    )
    name = models.CharField(max_length=200)
    version = models.PositiveIntegerField(default=1)
    spec = models.JSONField()
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)
    deleted_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["owner", "created_at"], name="calendar_owner_idx")]

    def __str__(self) -> str:
        return f"{self.name} ({self.id})"


class CalendarVersion(models.Model):
    """Immutable snapshot of a calendar's spec at each change."""

    calendar = models.ForeignKey(Calendar, on_delete=models.CASCADE, related_name="versions")
    version = models.PositiveIntegerField()
    spec = models.JSONField()
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["calendar", "version"], name="calendar_version_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.calendar_id} v{self.version}"


class JobCalendar(models.Model):
    """A job's current version names a calendar (`exclude` or `only`): the index through
    which a calendar's edit finds exactly the jobs it moves. Rewritten with the job's spec."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="+", db_index=False)
    calendar = models.ForeignKey(Calendar, on_delete=models.CASCADE, related_name="job_links",
                                 db_index=False)  # fmt: skip
    role = models.CharField(max_length=8)  # "exclude" | "only"

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["job", "calendar", "role"], name="job_calendar_unique"),
        ]
        indexes = [models.Index(fields=["calendar", "job"], name="job_calendar_by_calendar_idx")]

    def __str__(self) -> str:
        return f"{self.job_id} {self.role} {self.calendar_id}"


# -- notifications: webhooks and their deliveries ------------------------------------------


class WebhookEvent(models.TextChoices):
    """What a webhook may subscribe to; `ping` is sent only by the test/ action."""

    RUN_FAILED = "run.failed"
    RUN_UNDELIVERABLE = "run.undeliverable"
    JOB_PAUSED_AFTER_FAILURES = "job.paused_after_failures"
    QUEUE_PAUSED = "queue.paused"
    RUN_SUCCEEDED = "run.succeeded"  # opt-in: only webhooks that name it


class Webhook(models.Model):
    """An owner's subscription: the events it is told of, by a signed POST to `url`, for
    all of the owner's jobs or only `jobs`."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="webhooks"
    )
    url = models.URLField(max_length=2000)
    events = ArrayField(models.CharField(max_length=40, choices=WebhookEvent.choices))
    # None: every job of the owner, present and future.
    jobs = ArrayField(models.UUIDField(), null=True, blank=True)
    # The HMAC key of the signatures: shown once, in the answer to the creation.
    secret = models.CharField(max_length=100)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        indexes = [models.Index(fields=["owner", "created_at"], name="webhook_owner_idx")]

    def __str__(self) -> str:
        return f"webhook {self.url} of {self.owner_id}"


class WebhookDeliveryState(models.TextChoices):
    """A delivery's lifecycle; dispatch.webhooks moves it out of `pending`."""

    PENDING = "pending"  # posted at next_attempt_at, again and again until a 2xx
    DELIVERED = "delivered"  # terminal: a 2xx answer
    ABANDONED = "abandoned"  # terminal: no 2xx within the retry window (days)


class WebhookDelivery(models.Model):
    """One event told to one webhook: written in the transaction of the event (a trigger
    on the run's terminal transition, storage.webhooks), posted by dispatch.webhooks. Its
    id is the `X-Scheduler-Delivery` of every try: receivers deduplicate by it."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    webhook = models.ForeignKey(Webhook, on_delete=models.CASCADE, related_name="deliveries")
    event = models.CharField(max_length=40)
    # What it reports; no foreign keys, so that retention's deletion of a run keeps the
    # record of what was told.
    job_id = models.UUIDField(null=True, blank=True)
    run_id = models.UUIDField(null=True, blank=True)
    data = models.JSONField(null=True, blank=True)  # the event's own data (queue.paused, ping)
    # The request body, rendered at the first try and sent the same at every later one.
    body = models.TextField(blank=True, default="")
    state = models.CharField(
        max_length=16,
        choices=WebhookDeliveryState.choices,
        default=WebhookDeliveryState.PENDING,
    )
    created_at = models.DateTimeField(db_default=Now())
    # When the next try is due; a try in flight holds it a lease ahead (a poster killed
    # mid-post leaves it to be tried again, under the same id, once the lease is over).
    next_attempt_at = models.DateTimeField(db_default=Now())
    attempt_count = models.PositiveIntegerField(default=0)
    last_status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name_plural = "webhook deliveries"
        indexes = [
            models.Index(
                fields=["next_attempt_at"],
                name="webhook_delivery_due_idx",
                condition=Q(state="pending"),
            ),
            models.Index(fields=["webhook", "-created_at"], name="webhook_delivery_idx"),
            # The pruner's: finished deliveries by age (dispatch.pruner).
            models.Index(
                fields=["created_at"],
                name="webhook_delivery_done_idx",
                condition=Q(state__in=["delivered", "abandoned"]),
            ),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(state__in=WebhookDeliveryState.values),
                name="webhook_delivery_state_valid",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.event} delivery {self.id} ({self.state})"


class WebhookAttempt(models.Model):
    """One POST of a delivery: recorded when it starts, completed with its answer (a
    poster killed mid-post leaves it without one)."""

    delivery = models.ForeignKey(WebhookDelivery, on_delete=models.CASCADE, related_name="attempts")
    number = models.PositiveIntegerField()
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    error = models.TextField(blank=True, default="")

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["delivery", "number"], name="webhook_attempt_unique"),
        ]

    def __str__(self) -> str:
        return f"attempt {self.number} of {self.delivery_id}"


# -- dependencies between jobs (jobs.dependencies) ---------------------------------------


class JobDependency(models.Model):
    """An edge of the dependency graph: `dependent` (a job whose schedule is of kind `after`)
    runs when `upstream`'s runs end. Rewritten with the dependent's version; a run's end
    finds its job's dependents through `job_dependency_upstream_idx`, never its history."""

    dependent = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="+", db_index=False)
    upstream = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="+", db_index=False)

    class Meta:
        db_table = "jobs_dependency"
        constraints = [
            models.UniqueConstraint(fields=["dependent", "upstream"], name="job_dependency_unique"),
        ]
        indexes = [models.Index(fields=["upstream"], name="job_dependency_upstream_idx")]

    def __str__(self) -> str:
        return f"{self.dependent_id} after {self.upstream_id}"


class DependencySignal(models.Model):
    """A run of a job that has dependents reached a terminal state: written by the trigger
    `run_ended_signals_dependents` (storage.dependencies) in the transaction of that
    transition, whatever made it; consumed (and deleted) by the scheduler's dependencies
    step (dispatch.dependencies) in the transaction that records its effect."""

    id = models.BigAutoField(primary_key=True)
    run_id = models.UUIDField()
    job_id = models.UUIDField()
    state = models.CharField(max_length=16)
    kind = models.CharField(max_length=16)
    scheduled_for = models.DateTimeField()
    # When it was written (the database's clock); set ahead when its application failed,
    # to be tried again then (jobs.dependencies.SIGNAL_RETRY).
    created_at = models.DateTimeField()

    class Meta:
        db_table = "jobs_dependency_signal"
        indexes = [models.Index(fields=["created_at"], name="dependency_signal_due_idx")]

    def __str__(self) -> str:
        return f"run {self.run_id} of {self.job_id} ended {self.state}"


class GateState(models.TextChoices):
    """A dependent occurrence's gate; each comment names what moves it on."""

    WAITING = "waiting"  # upstreams missing: their signals, or the deadline (within_seconds)
    HELD = "held"  # complete while its job was paused: decided by misfire policy on resume
    DECIDED = "decided"  # terminal: its run (or skipped run) exists, or its job was gone


class DependencyGate(models.Model):
    """One occurrence of a dependent job: (job, instant, kind), counting the upstreams still
    missing. Decided exactly once: every change is a conditional update on `state`, made
    while the row is locked (jobs.dependencies)."""

    id = models.BigAutoField(primary_key=True)
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="+", db_index=False)
    scheduled_for = models.DateTimeField()
    kind = models.CharField(max_length=16, choices=RunKind.choices)
    state = models.CharField(max_length=16, choices=GateState.choices, default=GateState.WAITING)
    missing = models.PositiveIntegerField()
    arrived_jobs = ArrayField(models.UUIDField(), default=list)
    arrived_runs = ArrayField(models.UUIDField(), default=list)
    # When the first upstream arrived, plus within_seconds: the deadline loop skips it then.
    deadline_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField()
    # When its last upstream arrived (held gates: the misfire policy counts from here).
    ready_at = models.DateTimeField(null=True, blank=True)
    # The run it decided (queued or skipped): its upstream runs are `arrived_runs`
    # (jobs.dependencies.dependency_upstream_runs; the API's `upstream_runs`).
    run = models.ForeignKey(
        Run, null=True, blank=True, on_delete=models.SET_NULL, related_name="dependency_gates"
    )

    class Meta:
        db_table = "jobs_dependency_gate"
        constraints = [
            models.UniqueConstraint(
                fields=["job", "scheduled_for", "kind"], name="dependency_gate_unique"
            ),
        ]
        indexes = [
            models.Index(
                fields=["deadline_at"],
                name="dependency_gate_deadline_idx",
                condition=Q(state="waiting", deadline_at__isnull=False),
            ),
            models.Index(
                fields=["job", "ready_at"],
                name="dependency_gate_held_idx",
                condition=Q(state="held"),
            ),
        ]

    def __str__(self) -> str:
        return f"gate {self.job_id} at {self.scheduled_for:%Y-%m-%d %H:%M:%S} ({self.state})"
