"""Reconciliation: finds runs that the normal path should have moved but did not, repairs
them, and counts and records every repair in the run's history.

- A run `queued` whose message was published long ago but that no worker claimed (the
  message was lost in the broker, or discarded by a worker that does not know the task, or
  acknowledged by a worker that died before its claim), seen by its queue being empty or
  by later messages of its queue having been claimed already: published again, each time
  after twice the wait of the time before; with `max_republish` set it fails as
  `undeliverable` after that many.
- A run `running` without a running attempt holding its token (only a bug or a hand edit
  makes one): treated like a lost attempt, retried or failed by the job's policy.
- Outbox rows pending too long: the relay keeps retrying them; here they are alarmed.

Every repair is one conditional update on rows claimed with FOR UPDATE SKIP LOCKED, so any
number of replicas may run it; no transaction waits on the broker.

A pass costs the same however many runs are queued: it examines a window of at most
`scan_size` queued runs, read from run_queued_unheld_idx alone (queued runs not marked as
held back): the oldest tenth, and a walk that starts where the previous one ended (wrapping
round to the oldest when it reaches the cutoff); only those are checked for a pending
outbox row, read for their queue and locked. A lost run behind N unmarked queued runs is
found within ceil(N / (0.9 scan_size)) passes while N holds still, and once every run
queued before it has gone (a lost run stays queued, so it becomes one of the oldest) at
every pass, however fast new runs cross the cutoff.

Runs held back on purpose (their message waits in the outbox: backpressure, a paused
queue, an owner's limit) are marked so, and so leave that index: each pass first marks
those among the oldest `mark_size` unmarked queued runs, and those in its window, that have
had a pending outbox row since before the cutoff (`Run.held_at`, the `updated_at` they
had). Each held run is written once, by reconciliation, never on the relay's path; any
later stamp of `updated_at` voids the mark (the relay stamps a run it publishes late,
runs_stamp_published_late; a republication and every transition stamp it too), so a
published run is never hidden. N above counts published runs not yet claimed and runs
held back since the last passes, not the held backlog: a backlog of H held runs costs
ceil(H / mark_size) passes once, when they first cross the cutoff.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import uuid
from collections.abc import Callable

from django.db import transaction
from django.db.models import Count, Exists, F, Max, Min, OuterRef, Q, Subquery
from kombu import Connection

from jobs.audit import audit_record
from jobs.counters import counter_increment
from jobs.models import (
    Attempt,
    AttemptState,
    FailureReason,
    OutboxMessage,
    OutboxState,
    Run,
    RunState,
)
from jobs.outbox import outbox_enqueue_runs, run_lane_queue
from jobs.outcomes import runs_record_orphaned
from jobs.transitions import run_count_republish, run_give_up
from storage.runs import runs_mark_held

from .broker import queue_depth
from .config import config_require
from .loop import BROKER_ERRORS
from .relay import LATE_PUBLICATION_SECONDS
from .shares import MAX_QUEUES, owner_at_limit

log = logging.getLogger("dispatch.reconciler")

# queue name -> ready messages in it, or None when the broker cannot tell.
QueueDepth = Callable[[str], "int | None"]


BACKOFF_STEPS = 6  # the wait before a re-publication doubles up to 2**6 times
# The stuck-outbox alarm reads at most the oldest STUCK_ROWS stuck rows, and judges at most
# STUCK_GROUPS of their (queue, owner) groups, oldest first: bounded however long the
# backlog that backpressure and owners' limits keep on purpose.
STUCK_ROWS = 10_000
STUCK_GROUPS = 100
RECENT_CLAIMS = 1000  # the claims read for messages delivered after a lost one


@dataclasses.dataclass(frozen=True)
class ReconcileConfig:
    batch_size: int = 200
    poll_interval: float = 5.0
    # A published run with no attempt after this long is presumed lost in the broker. While
    # its queue still holds ready messages it may only be waiting, and is left alone,
    # unless its queue delivered a message published this long after it.
    queued_after_seconds: float = 300.0
    # None: never give up (the default: a message held in a busy worker's prefetch buffer
    # cannot be told from a lost one, and giving up would fail a run that is only waiting).
    max_republish: int | None = None
    running_orphan_after_seconds: float = 30.0
    outbox_alarm_after_seconds: float = 60.0
    scan_size: int = 2000  # queued runs examined per pass (module docstring)
    mark_size: int = 20_000  # oldest unmarked queued runs looked at for held ones per pass
    # What the relays hold rows back for (SCHEDULER_QUEUE_HIGH_WATER,
    # SCHEDULER_OWNER_MAX_ACTIVE_RUNS): rows waiting for them are not alarmed as stuck.
    queue_high_water: int | None = None
    owner_max_active_runs: int | None = None

    def __post_init__(self) -> None:
        config_require(
            self,
            at_least_one=(
                "batch_size",
                "scan_size",
                "mark_size",
                "queue_high_water",
                "owner_max_active_runs",
            ),
            positive=(
                "poll_interval",
                "queued_after_seconds",
                "running_orphan_after_seconds",
                "outbox_alarm_after_seconds",
            ),
            non_negative=("max_republish",),
        )


@dataclasses.dataclass
class ReconcileWindow:
    """Where the previous pass's walk over the queued runs ended: (updated_at, id) of the
    last run it examined, None before the first pass. Owned by the reconciliation loop (one
    per loop: each replica walks the queued runs in turn from its own), created where the
    loop is built and passed to every `reconcile_run_once`, which moves it on."""

    end: tuple[dt.datetime, uuid.UUID] | None = None


@dataclasses.dataclass(frozen=True)
class ReconcileResult:
    republished: int = 0
    undeliverable: int = 0
    orphans_repaired: int = 0
    outbox_stuck: int = 0
    # Rows past the alarm's age whose wait backpressure or an owner's limit explains.
    outbox_held_back: int = 0


def reconcile_run_once(
    *, now: dt.datetime, config: ReconcileConfig, queue_depth: QueueDepth, window: ReconcileWindow
) -> ReconcileResult:
    _mark_held(now=now, config=config, ids=None)
    republished, undeliverable = _republish_lost_messages(
        now=now, config=config, queue_depth=queue_depth, window=window
    )
    with transaction.atomic():
        orphans = _repair_orphaned_running(now=now, config=config)
    stuck, held_back = _alarm_stuck_outbox(now=now, config=config, queue_depth=queue_depth)
    return ReconcileResult(
        republished=republished,
        undeliverable=undeliverable,
        orphans_repaired=orphans,
        outbox_stuck=stuck,
        outbox_held_back=held_back,
    )


def _record(run: Run, *, action: str, kind: str, data: dict) -> None:
    audit_record(action=action, by="reconciler", job_id=run.job_id, run_id=run.id, data=data)
    counter_increment("scheduler_reconcile_repairs_total", labels=f'kind="{kind}"')


def _published_long_ago(*, now: dt.datetime, config: ReconcileConfig, window: ReconcileWindow):
    """Queued runs whose message was published (no outbox row is left pending) and that have
    waited out their back-off since: the runs that may be lost, with their queue.

    A run is published at (in practice a few ms after) the instant it entered `queued` or
    was last republished, both of which stamp `updated_at`.
    """
    wait = dt.timedelta(seconds=config.queued_after_seconds)
    # Each re-publication waits twice as long as the one before (up to 64x): in SQL, so
    # that runs still waiting out their back-off never fill the batch.
    backed_off = Q(republish_count__gte=BACKOFF_STEPS, updated_at__lt=now - wait * 2**BACKOFF_STEPS)
    for count in range(BACKOFF_STEPS):
        backed_off |= Q(republish_count=count, updated_at__lt=now - wait * 2**count)
    return (
        Run.objects.filter(id__in=_window(now=now, config=config, window=window))
        .filter(backed_off)
        .filter(~Exists(OutboxMessage.objects.filter(run=OuterRef("pk"))))
        .annotate(message_queue=run_lane_queue())
    )


def _mark_held(*, now: dt.datetime, config: ReconcileConfig, ids: list | None) -> int:
    """Mark the held runs among the oldest `mark_size` unmarked queued runs before the
    cutoff (or among `ids`): those whose pending outbox row was written before the cutoff,
    and at least twice LATE_PUBLICATION_SECONDS ago, so that the relay stamps them when it
    publishes them, which voids the mark (module docstring)."""
    cutoff = now - dt.timedelta(seconds=config.queued_after_seconds)
    pending_before = min(cutoff, now - dt.timedelta(seconds=2 * LATE_PUBLICATION_SECONDS))
    return runs_mark_held(
        updated_before=cutoff, pending_before=pending_before, limit=config.mark_size, ids=ids
    )


def _window(*, now: dt.datetime, config: ReconcileConfig, window: ReconcileWindow) -> list:
    """The ids of up to `scan_size` runs queued before the cutoff and not marked as held
    back, read from run_queued_unheld_idx alone (the held ones among them are marked
    then, and never walked again while held): the oldest tenth (a lost run is never
    republished by anyone else, so it stays among the oldest: looked at again every pass,
    once evidence of its loss exists), and the rest in (updated_at, id) order from where
    the loop's previous walk ended (`window`), wrapping round to the oldest at the cutoff
    (module docstring), ties on `updated_at` (runs made by one statement) included, at a
    bounded cost each."""
    cutoff = now - dt.timedelta(seconds=config.queued_after_seconds)
    queued = Run.objects.filter(state=RunState.QUEUED, updated_at__lt=cutoff).exclude(
        held_at=F("updated_at")
    )
    ordered = queued.order_by("updated_at", "id").values_list("updated_at", "id")
    oldest = list(ordered[: max(1, config.scan_size // 10)])
    seen = {run_id for _, run_id in oldest}
    walk = []
    if window.end is not None:
        at, run_id = window.end
        after = Q(updated_at__gt=at) | Q(updated_at=at, id__gt=run_id)
        walk = list(ordered.filter(updated_at__gte=at).filter(after)[: config.scan_size])
        walk = [row for row in walk if row[1] not in seen][: config.scan_size - len(oldest)]
    if len(oldest) + len(walk) < config.scan_size:  # the walk reached the cutoff: wrap round
        seen |= {run_id for _, run_id in walk}
        rest = ordered[: config.scan_size]
        walk += [row for row in rest if row[1] not in seen][
            : config.scan_size - len(oldest) - len(walk)
        ]
    last = walk[-1:] or oldest[-1:]
    window.end = last[0] if last else None
    ids = [run_id for _, run_id in oldest + walk]
    if ids:
        _mark_held(now=now, config=config, ids=ids)
    return ids


def _latest_claimed_creations(queues: list[str]) -> dict[str, dt.datetime]:
    """For each queue, the latest creation of a run that a worker claimed among the last
    RECENT_CLAIMS claims. A run is published no earlier than it is created, whatever order
    the relays take (priority, owners' shares, backpressure), and a queued run's
    `updated_at` is its publication (within seconds; a row held back in the outbox has it
    stamped when published, runs_stamp_published_late), so a run claimed from a queue that
    was created well after another run's `updated_at` there was published after it."""
    recent = Attempt.objects.order_by("-id").values("run_id")[:RECENT_CLAIMS]
    rows = (
        Run.objects.filter(id__in=Subquery(recent))
        .annotate(message_queue=run_lane_queue())
        .filter(message_queue__in=queues)
        .values("message_queue")
        .annotate(latest=Max("created_at"))
        .values_list("message_queue", "latest")
    )
    return dict(rows)


def _republish_lost_messages(
    *, now: dt.datetime, config: ReconcileConfig, queue_depth: QueueDepth, window: ReconcileWindow
) -> tuple[int, int]:
    """A published, unclaimed run is lost when its queue holds no ready message (it cannot
    be waiting in line), or when a worker claimed from its queue a run created more than
    the wait after this one was queued (RabbitMQ queues are first in, first out, and a run
    is never published before it is created: this one should have come first). Both sides are
    queue-side times, not publication times, so a backlog published late after a relay or
    broker outage is not mistaken for lost: its runs were all queued before the ones that
    are claimed first. The evidence is gathered outside any transaction (the broker's queue depths
    are network calls); the repair rechecks everything under the row lock."""
    wait = dt.timedelta(seconds=config.queued_after_seconds)
    candidates = _published_long_ago(now=now, config=config, window=window)
    # Asked per queue first, so that a backlog on one queue never starves the others.
    queues = sorted(
        candidates.order_by().values_list("message_queue", flat=True).distinct()[:MAX_QUEUES]
    )
    if not queues:
        return 0, 0
    overtaken_after = _latest_claimed_creations(queues)
    idle = [queue for queue in queues if queue_depth(queue) == 0]
    evidence = Q(message_queue__in=idle)
    for queue, created_at in overtaken_after.items():
        evidence |= Q(message_queue=queue, updated_at__lt=created_at - wait)
    republished = undeliverable = 0
    with transaction.atomic():
        runs = list(
            candidates.filter(evidence)
            .select_for_update(skip_locked=True, of=("self",))
            .select_related("job_version")
            .order_by("updated_at", "created_at")[: config.batch_size]
        )
        for run in runs:
            lost_because = "queue_idle" if run.message_queue in idle else "later_message_claimed"
            if config.max_republish is not None and run.republish_count >= config.max_republish:
                if run_give_up(run_id=run.id, now=now, reason=FailureReason.UNDELIVERABLE):
                    undeliverable += 1
                    _record(run, action="run.undeliverable", kind="undeliverable",
                            data={"republished": run.republish_count})  # fmt: skip
                continue
            if not run_count_republish(run_id=run.id, now=now):
                continue
            outbox_enqueue_runs(runs=[run], now=now)
            republished += 1
            _record(run, action="run.republished", kind="republished",
                    data={"last_published_at": run.updated_at.isoformat(),
                          "republish": run.republish_count + 1,
                          "lost_because": lost_because})  # fmt: skip
            log.warning(
                "run %s was published but never claimed (%s); published it again",
                run.id,
                lost_because,
            )
    return republished, undeliverable


def _repair_orphaned_running(*, now: dt.datetime, config: ReconcileConfig) -> int:
    live = Attempt.objects.filter(
        run=OuterRef("pk"), state=AttemptState.RUNNING, fencing_token=OuterRef("fencing_token")
    )
    orphans = list(
        Run.objects.select_for_update(skip_locked=True, of=("self",))
        .select_related("job_version")
        .filter(
            state=RunState.RUNNING,
            updated_at__lt=now - dt.timedelta(seconds=config.running_orphan_after_seconds),
        )
        .filter(~Exists(live))[: config.batch_size]
    )
    repaired = 0
    moved = runs_record_orphaned(runs=orphans, now=now)
    for run in orphans:
        if run.id in moved:
            repaired += 1
            _record(run, action="run.orphan_repaired", kind="orphaned_running",
                    data={"fencing_token": run.fencing_token, "to": moved[run.id]})  # fmt: skip
            log.error("run %s was running without a live attempt; repaired", run.id)
    return repaired


def _alarm_stuck_outbox(
    *, now: dt.datetime, config: ReconcileConfig, queue_depth: QueueDepth
) -> tuple[int, int]:
    """Pending rows older than the alarm threshold: logged at ERROR (and so to Sentry), and
    exported as scheduler_outbox_oldest_pending_seconds; the relay keeps retrying them.
    Judged per (queue, owner): a group the relay never failed on that waits by design (its
    queue at its high-water mark, or its owner at its limit of active runs) is only noted;
    any other raises the ERROR. Returns (stuck rows, held rows), of the oldest STUCK_ROWS
    and the oldest rows a relay failed on (which held rows before them never hide)."""
    cutoff = now - dt.timedelta(seconds=config.outbox_alarm_after_seconds)
    groups = list(
        OutboxMessage.objects.filter(
            Q(id__in=Subquery(_oldest_stuck(cutoff))) | Q(id__in=Subquery(_oldest_failing(cutoff)))
        )
        .values("queue", "owner_id")
        .annotate(
            rows=Count("id"),
            tries=Max("publish_tries"),
            error=Max("last_error"),
            since=Min("created_at"),
        )  # fmt: skip
        .order_by("since")
    )
    if not groups:
        return 0, 0
    depths: dict[str, int | None] = {}
    at_limit: dict[object, bool] = {}
    stuck_groups, stuck, held = [], 0, 0
    for index, group in enumerate(groups):
        # Groups past STUCK_GROUPS are not judged: the oldest ones decide.
        if index < STUCK_GROUPS and (
            group["tries"] or not _held_back(group, config, queue_depth, depths, at_limit)
        ):
            stuck_groups.append(group)
            stuck += group["rows"]
        else:
            held += group["rows"]
    total = f"{stuck + held}{'+' if stuck + held >= STUCK_ROWS else ''}"
    if not stuck_groups:
        log.info("%s outbox rows waiting for over %.0fs: held back by backpressure or an "
                 "owner's limit", total, config.outbox_alarm_after_seconds)  # fmt: skip
        return 0, held
    worst = stuck_groups[0]
    log.error(
        "%d outbox rows pending for over %.0fs (of %s; %d queue/owner groups not held back; "
        "the oldest: queue %s, owner %s, tries %s, last error %s)",
        stuck,
        config.outbox_alarm_after_seconds,
        total,
        len(stuck_groups),
        worst["queue"],
        worst["owner_id"],
        worst["tries"],
        worst["error"][:300],
    )
    return stuck, held


def _oldest_stuck(cutoff: dt.datetime):
    """The ids of the oldest STUCK_ROWS rows pending since before `cutoff`, read from
    outbox_pending_age_idx, never the whole backlog."""
    stuck = OutboxMessage.objects.filter(state=OutboxState.PENDING, created_at__lt=cutoff)
    return stuck.order_by("created_at").values("id")[:STUCK_ROWS]


def _oldest_failing(cutoff: dt.datetime):
    """The ids of the oldest rows a relay failed to publish, pending since before `cutoff`
    (outbox_failing_idx): however many rows are held back on purpose before them."""
    failing = OutboxMessage.objects.filter(
        state=OutboxState.PENDING, publish_tries__gt=0, created_at__lt=cutoff
    )
    return failing.order_by("created_at").values("id")[:STUCK_GROUPS]


def _held_back(
    group: dict, config: ReconcileConfig, queue_depth: QueueDepth, depths: dict, at_limit: dict
) -> bool:
    """Whether the relays hold this (queue, owner)'s rows back on purpose: its queue is at
    its high-water mark, or its owner has its limit of runs in the broker or running. The
    broker is asked once per queue and pass (`depths`), an owner's limit read once
    (`at_limit`)."""
    queue, owner = group["queue"], group["owner_id"]
    if config.queue_high_water is not None:
        if queue not in depths:
            depths[queue] = queue_depth(queue) if len(depths) < MAX_QUEUES else None
        if depths[queue] is not None and depths[queue] >= config.queue_high_water:
            return True
    if owner not in at_limit:
        at_limit[owner] = owner_at_limit(owner, default_limit=config.owner_max_active_runs)
    return at_limit[owner]


class BrokerQueueDepth:
    """Ready messages in a queue, asked of the broker with a passive declare; None when the
    broker cannot be reached (then nothing is re-published: it could not be sent anyway)."""

    def __init__(self, broker_url: str, transport_options: dict) -> None:
        self.connection = Connection(broker_url, transport_options=transport_options)

    def __call__(self, queue: str) -> int | None:
        try:
            self.connection.ensure_connection(max_retries=1)
            with self.connection.channel() as channel:
                return queue_depth(channel, queue)
        except BROKER_ERRORS as exc:
            if "NOT_FOUND" in str(exc) or "404" in str(exc):
                return 0  # no such queue: nothing can be waiting in it
            log.warning("could not read the depth of queue %s: %r", queue, exc)
            self.connection = self.connection.clone()
            return None

    def close(self) -> None:
        self.connection.release()
