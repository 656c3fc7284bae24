"""Queues as objects an operator manages: pause (optionally until an instant) and resume,
a cap on the runs running at once and a rate of publications, across the whole fleet.

Each configured queue (SCHEDULER_QUEUES) controls its lanes too (jobs.lanes). A queue
without a QueueControl row is free. Where each control is enforced:
- a pause: the relays publish none of the queue's outbox rows (the runs wait in
  PostgreSQL, created as usual), and a worker delivered a run of a paused queue hands it
  back (`run_hand_back`: a new outbox row, no attempt charged);
- `max_running`: the relays publish no more than the cap leaves (runs running or in the
  broker), and the worker's claim counts the queue's running runs under the queue row's
  lock, handing back a run over the cap;
- `rate_limit`: a token bucket in the queue's row, taken by the relays before they publish
  (storage.queues.queue_tokens_take): a shared row is the one store every relay already
  reaches, atomic with a conditional UPDATE, and kept across restarts.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction

from storage.outbox import outbox_renumber_in_due_order
from storage.queues import queues_figures, queues_pause_expired_end, run_has_pending_message

from .audit import audit_record
from .lanes import LANES, REPLAY_LANE, lanes_of
from .models import QueueControl, Run, RunState
from .notify import CHANNEL_OUTBOX, notify
from .outbox import outbox_enqueue_runs
from .webhooks import webhook_event_record

_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*(s|sec|second|m|min|minute|h|hour)\s*$")
_PERIOD_SECONDS = {"s": 1, "sec": 1, "second": 1, "m": 60, "min": 60, "minute": 60,
                   "h": 3600, "hour": 3600}  # fmt: skip


class RateLimitInvalid(ValueError):
    pass


def rate_limit_parse(value: str) -> tuple[float, float]:
    """("100/s" -> 100 a second, burst 100); ("6000/min" -> 100 a second, burst 100): the
    burst is one second's worth, at least one run."""
    match = _RATE.match(value or "")
    if not match:
        raise RateLimitInvalid(f"'{value}' is not a rate: write '<runs>/s', '/min' or '/hour'.")
    count = float(match.group(1))
    if count <= 0:
        raise RateLimitInvalid("a rate must be above 0 (null removes the limit).")
    per_second = count / _PERIOD_SECONDS[match.group(2)]
    return per_second, max(1.0, per_second)


def queue_configured(name: str) -> bool:
    return name in settings.SCHEDULER_QUEUES


def _control(name: str) -> QueueControl:
    control, _ = QueueControl.objects.select_for_update().get_or_create(name=name)
    return control


def queue_pause(
    *, name: str, actor: AbstractBaseUser, reason: str, until: dt.datetime | None, now: dt.datetime
) -> QueueControl:
    """Pause the queue (and its lanes) until resumed or `until`; audited. Takes effect at
    commit: the claims in flight hold the row's share lock, so when this returns no later
    claim starts a run of the queue, and the relays see it at their next step."""
    with transaction.atomic():
        control = _control(name)
        was = queue_paused_now(control, now=now)
        control.paused, control.paused_reason, control.paused_until = True, reason, until
        control.paused_at, control.paused_by = now, f"user:{actor.get_username()}"[:200]
        control.save()
        audit_record(action="queue.paused", actor=actor,
                     data={"queue": name, "reason": reason,
                           "until": until.isoformat() if until else None})  # fmt: skip
        if not was:  # owners hear of the pause itself, not of each change of its reason
            webhook_event_record(event="queue.paused", now=now, data={"queue": {
                "name": name, "reason": reason, "until": until.isoformat() if until else None,
            }})  # fmt: skip
    return control


def queue_resume(*, name: str, actor: AbstractBaseUser) -> QueueControl:
    """Resume the queue: the relays publish its waiting runs (in due order) at once. The
    rows of runs handed back from the broker were written after the rows already waiting:
    the queue's waiting rows (its lanes' too) are renumbered in due order first."""
    with transaction.atomic():
        control = _control(name)
        was = control.paused
        control.paused, control.paused_until = False, None
        control.save()
        if was:
            outbox_renumber_in_due_order(queues=[name, *lanes_of(name)])
            audit_record(action="queue.resumed", actor=actor, data={"queue": name})
        notify(CHANNEL_OUTBOX)
    return control


def queue_pauses_end_expired() -> list[str]:
    """End the pauses whose `until` has passed as a resume ends one: the queue's waiting
    rows (its lanes' too) renumbered in due order, audited, in one transaction with the
    conditional update that clears the pause, so that it happens once whoever notices it
    (every relay step starts with it, before it reads the queues' controls). The names of
    the queues resumed."""
    with transaction.atomic():
        names = queues_pause_expired_end()
        for name in names:
            outbox_renumber_in_due_order(queues=[name, *lanes_of(name)])
            audit_record(action="queue.resumed", by="relay",
                         data={"queue": name, "ended_by": "until"})  # fmt: skip
        if names:
            notify(CHANNEL_OUTBOX)
    return names


_UNSET = object()


def queue_update(
    *, name: str, actor: AbstractBaseUser, max_running=_UNSET, rate_limit=_UNSET
) -> QueueControl:
    """Set or remove (None) the queue's cap and rate; audited. A new rate starts with a
    full bucket (one burst)."""
    with transaction.atomic():
        control = _control(name)
        changed = {}
        if max_running is not _UNSET:
            control.max_running = changed["max_running"] = max_running
        if rate_limit is not _UNSET:
            changed["rate_limit"] = rate_limit
            if rate_limit is None:
                control.rate_limit, control.rate_per_second, control.burst = "", None, None
            else:
                per_second, burst = rate_limit_parse(rate_limit)
                control.rate_limit, control.rate_per_second = rate_limit.strip(), per_second
                control.burst, control.tokens, control.tokens_at = burst, burst, None
        control.save()
        audit_record(action="queue.updated", actor=actor, data={"queue": name, **changed})
        notify(CHANNEL_OUTBOX)
    return control


@dataclasses.dataclass(frozen=True)
class QueueView:
    name: str
    lane_of: str | None  # the configured queue a lane belongs to
    paused: bool
    paused_reason: str
    paused_until: dt.datetime | None
    ready: int | None  # in the broker (None: the broker could not say)
    waiting: int  # held in PostgreSQL
    running: int
    max_running: int | None
    rate_limit: str | None


def queue_paused_now(control: QueueControl | None, *, now: dt.datetime) -> bool:
    return bool(
        control and control.paused and (control.paused_until is None or control.paused_until > now)
    )


def queue_note(*, queue: str, now: dt.datetime) -> str:
    """The `queue:` note of an occurrence whose queue is paused now ("" when it is not):
    its run is created as usual and waits, and starts when the queue resumes."""
    control = QueueControl.objects.filter(name=queue).first()
    if not queue_paused_now(control, now=now):
        return ""
    until = f" until {control.paused_until:%Y-%m-%d %H:%M:%S}Z" if control.paused_until else ""
    why = f" ({control.paused_reason})" if control.paused_reason else ""
    return f"queue: '{control.name}' is paused{why}{until}; its runs wait and start on resume"


def queue_list(*, now: dt.datetime, depth=None) -> list[QueueView]:
    """Every configured queue followed by its lanes, with its figures; `depth(name)` the
    broker's ready count (None when it cannot say)."""
    names = [n for queue in settings.SCHEDULER_QUEUES for n in (queue, *lanes_of(queue))]
    controls = {c.name: c for c in QueueControl.objects.filter(name__in=settings.SCHEDULER_QUEUES)}
    figures = queues_figures(queues=names, lanes=LANES, replay_lane=REPLAY_LANE)
    views = []
    for queue in settings.SCHEDULER_QUEUES:
        control = controls.get(queue)
        for name in (queue, *lanes_of(queue)):
            views.append(QueueView(
                name=name, lane_of=None if name == queue else queue,
                paused=queue_paused_now(control, now=now),
                paused_reason=control.paused_reason if queue_paused_now(control, now=now) else "",
                paused_until=control.paused_until if queue_paused_now(control, now=now) else None,
                ready=depth(name) if depth else None, waiting=figures[name].waiting,
                running=figures[name].running,
                max_running=control.max_running if control else None,
                rate_limit=(control.rate_limit or None) if control else None,
            ))  # fmt: skip
    return views


def run_hand_back(*, run_id, now: dt.datetime) -> bool:
    """A delivered run of a paused (or full) queue goes back to wait in PostgreSQL: still
    `queued`, its attempt count untouched, with a pending outbox row again (unless it has
    one), so a relay publishes it when the queue has room. Runs in the caller's
    transaction (the claim's, holding the queue row's lock). Whether a row was written."""
    run = Run.objects.select_related("job_version").filter(id=run_id, state=RunState.QUEUED).first()
    if run is None or run_has_pending_message(run_id=run_id):
        return False
    return outbox_enqueue_runs(runs=[run], now=now) > 0
