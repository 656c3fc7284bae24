"""Bulk operations: one action on every run or job a filter matched when it was asked for.

`operation_create` freezes the filter by writing the matching ids as items, in the
transaction that creates the operation (rows that arrive later are never among them).
`operations_run_batch` does one bounded batch of one running operation's items, each
through the single action's service (the same transition, the same audit event, the
operation's owner as its actor), in one transaction that also records each item's outcome
and the operation's counts: a crash loses the whole batch or none of it, so an item is done
exactly once, and the locks a batch takes (its runs' or jobs' rows) last one batch. The
relays call it between their own steps (dispatch.operations), so an operation goes on after
any crash of the process that asked for it or of the relay that worked it.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections import Counter
from collections.abc import Callable

from django.contrib.auth.models import AbstractBaseUser
from django.db import DatabaseError, transaction
from django.db.models import F, QuerySet

from .models import BulkOperation, BulkOperationItem, Job, Run
from .notify import CHANNEL_OUTBOX, notify
from .schedules import ScheduleError
from .selectors import job_list, run_list
from .services import job_cancel, job_pause, job_resume, run_cancel_request, run_replay_request
from .transitions import jobs_lock_to_cancel, runs_lock_to_cancel

DONE = "done"
log = logging.getLogger("jobs.operations")

# action -> (the model acted on, its service)
ACTIONS: dict[str, tuple[type, Callable[..., bool]]] = {
    "runs.cancel": (Run, run_cancel_request),
    "runs.replay": (Run, run_replay_request),
    "jobs.pause": (Job, job_pause),
    "jobs.resume": (Job, job_resume),
    "jobs.cancel": (Job, job_cancel),
}
ITEMS_WRITTEN_AT_ONCE = 5000


def operation_matching(*, user: AbstractBaseUser, action: str, filters: dict) -> QuerySet:
    """What the filter matches now, among what `user` may see (owners: their own)."""
    model, _ = ACTIONS[action]
    if model is Run:
        return run_list(user=user, filters=filters)
    return job_list(user=user, filters=filters)


def operation_count(*, user: AbstractBaseUser, action: str, filters: dict) -> int:
    return operation_matching(user=user, action=action, filters=filters).count()


def operation_create(
    *,
    user: AbstractBaseUser,
    action: str,
    targets: QuerySet,
    stored_filter: dict,
    now: dt.datetime,
) -> BulkOperation:
    """A running operation whose items are the ids `targets` (the filter's match, among
    what `user` may see) holds now, frozen, in one transaction; the relays are woken at
    commit. An empty match is done at once."""
    with transaction.atomic():
        operation = BulkOperation.objects.create(owner=user, action=action, filter=stored_filter,
                                                 created_at=now)  # fmt: skip
        ids = targets.values_list("id", flat=True)
        matched = 0
        batch: list[BulkOperationItem] = []
        for target in ids.order_by().iterator(chunk_size=ITEMS_WRITTEN_AT_ONCE):
            batch.append(BulkOperationItem(operation=operation, target=target))
            if len(batch) >= ITEMS_WRITTEN_AT_ONCE:
                matched += len(BulkOperationItem.objects.bulk_create(batch))
                batch = []
        matched += len(BulkOperationItem.objects.bulk_create(batch))
        operation.matched = matched
        if not matched:
            operation.state, operation.finished_at = BulkOperation.State.DONE, now
        operation.save(update_fields=["matched", "state", "finished_at"])
        notify(CHANNEL_OUTBOX)
    return operation


def _targets(action: str, targets: list) -> dict:
    """The batch's targets that still exist, by id, in one query (a run with its version,
    which queueing it again reads)."""
    model = ACTIONS[action][0]
    rows = model.objects.filter(id__in=targets)
    if model is Run:
        rows = rows.select_related("job_version")
    return {obj.id: obj for obj in rows}


def _act(action: str, obj, owner: AbstractBaseUser, now: dt.datetime) -> str:
    """Do the action on one target (None: it is gone): DONE, or the reason it was refused."""
    model, service = ACTIONS[action]
    keyword = "run" if model is Run else "job"
    if obj is None:
        return "gone"
    try:
        with transaction.atomic():  # a savepoint: an item that fails leaves the batch whole
            if service(**{keyword: obj}, actor=owner, now=now):
                return DONE
    except ScheduleError:
        return "schedule_ended"
    except DatabaseError:
        raise  # an outage: the batch is done again
    except Exception:  # noqa: BLE001 - one item's bug must not wedge the operation
        log.exception("bulk %s of %s failed", action, obj.pk)
        return "error"
    obj.refresh_from_db(fields=["state"])
    return f"state_{obj.state}"


def operations_run_batch(*, now: dt.datetime, batch_size: int) -> int:
    """One bounded batch of the oldest running operation with items left: its items locked
    FOR UPDATE SKIP LOCKED (relays split an operation's work), each action done and its
    outcome recorded, the counts added, and the operation marked done when no item is
    left; all in one transaction. The items done (0: no operation had work)."""
    for operation in BulkOperation.objects.filter(state=BulkOperation.State.RUNNING).order_by(
        "created_at"
    )[:10]:
        with transaction.atomic():
            items = list(
                BulkOperationItem.objects.select_for_update(skip_locked=True)
                .filter(operation=operation, outcome="")
                .order_by("id")[:batch_size]
            )
            if not items:
                _finish_if_empty(operation, now=now)
                continue
            if operation.action == "runs.cancel":
                # What the cancels change, locked first in the order a packed success
                # takes it (attempts, then runs, each in id order): one by one, in the
                # items' order, a batch and a pack of the same runs deadlocked.
                runs_lock_to_cancel(run_ids=[item.target for item in items])
            elif operation.action == "jobs.cancel":
                # The same for every run of the batch's jobs at once (job rows first).
                jobs_lock_to_cancel(job_ids=[item.target for item in items])
            targets = _targets(operation.action, [item.target for item in items])
            outcomes: Counter[str] = Counter()
            for item in items:
                item.outcome = _act(operation.action, targets.get(item.target),
                                    operation.owner, now)  # fmt: skip
                outcomes[item.outcome] += 1
            BulkOperationItem.objects.bulk_update(items, ["outcome"])
            refused_now = {reason: n for reason, n in outcomes.items() if reason != DONE}
            locked = BulkOperation.objects.select_for_update().get(id=operation.id)
            refused = dict(locked.refused)
            for reason, n in refused_now.items():
                refused[reason] = refused.get(reason, 0) + n
            BulkOperation.objects.filter(id=operation.id).update(
                done=F("done") + outcomes[DONE], refused=refused
            )
            _finish_if_empty(operation, now=now)
            return len(items)
    return 0


def _finish_if_empty(operation: BulkOperation, *, now: dt.datetime) -> bool:
    """running -> done when none of its items is left (a conditional update)."""
    if BulkOperationItem.objects.filter(operation=operation, outcome="").exists():
        return False
    return bool(
        BulkOperation.objects.filter(id=operation.id, state=BulkOperation.State.RUNNING).update(
            state=BulkOperation.State.DONE, finished_at=now
        )
    )
