"""The effect ledger: an effect recorded at most once per run, fenced by the attempt's token.

A handler writes `with ctx.effect(name) as effect:`; the block runs inside the ledger's
transaction, so the database writes it makes commit together with the ledger row, and only
while the attempt still holds the run's current fencing token, checked at the commit
(docs/semantics.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

from django.db import transaction

from .counters import counter_increment
from .errors import StaleAttempt
from .models import Effect, Run, RunState


@dataclasses.dataclass
class EffectRecord:
    name: str
    done: bool  # True: an earlier execution of this run already committed the effect


class _Superseded(Exception):
    """Raised inside the ledger's transaction to roll it back: the attempt is stale."""


@contextlib.contextmanager
def effect_once(
    *, run_id, name: str, attempt_number: int, fencing_token: int
) -> Iterator[EffectRecord]:
    """The block runs in a transaction; the ledger row commits with it while
    `fencing_token` is the run's current one, unless an earlier execution committed it
    (`record.done`). StaleAttempt, counted, when the attempt is no longer current.

    The fence is checked twice: before the block (a stale attempt does not run it) and at
    its end, where the run's row is locked for the few statements up to the commit: the
    handler's own code never runs while the run's row is locked, so the relay, the reaper
    and a cancel never wait on a handler (a token moved while the block ran rolls it
    back, its writes with it)."""
    if not _current(run_id, fencing_token, lock=False):
        _refuse(run_id, attempt_number)
    try:
        with transaction.atomic():
            done = Effect.objects.filter(run_id=run_id, name=name).exists()
            yield EffectRecord(name=name, done=done)
            if not _current(run_id, fencing_token, lock=True):
                raise _Superseded
            if not done:
                Effect.objects.create(
                    run_id=run_id,
                    name=name,
                    attempt_number=attempt_number,
                    fencing_token=fencing_token,
                )
    except _Superseded:
        _refuse(run_id, attempt_number)


def _current(run_id, fencing_token: int, *, lock: bool) -> bool:
    rows = Run.objects.filter(id=run_id, state=RunState.RUNNING, fencing_token=fencing_token)
    return (rows.select_for_update() if lock else rows).exists()


def _refuse(run_id, attempt_number: int) -> None:
    # Counted outside the refused transaction, so that the count survives.
    counter_increment("scheduler_stale_completions_total", labels='kind="effect"')
    raise StaleAttempt(f"attempt {attempt_number} of run {run_id} is stale")
