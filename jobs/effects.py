"""The effect ledger: an effect recorded at most once per run, fenced by the attempt's token.

A handler writes `with ctx.effect(name) as effect:`; the block runs inside the ledger's
transaction, so the database writes it makes commit together with the ledger row, and only
while the attempt still holds the run's current fencing token (docs/semantics.md).
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


@contextlib.contextmanager
def effect_once(
    *, run_id, name: str, attempt_number: int, fencing_token: int
) -> Iterator[EffectRecord]:
    """The block runs in a transaction holding the run's row, while `fencing_token` is the
    run's current one; the ledger row commits with it unless an earlier execution committed
    it (`record.done`). StaleAttempt, counted, when the attempt is no longer current."""
    with transaction.atomic():
        locked = (
            Run.objects.select_for_update()
            .filter(id=run_id)
            .values_list("state", "fencing_token")
            .first()
        )
        stale = locked != (RunState.RUNNING, fencing_token)
        if not stale:
            done = Effect.objects.filter(run_id=run_id, name=name).exists()
            yield EffectRecord(name=name, done=done)
            if not done:
                Effect.objects.create(
                    run_id=run_id,
                    name=name,
                    attempt_number=attempt_number,
                    fencing_token=fencing_token,
                )
    if stale:
        # Counted outside the refused transaction, so that the count survives.
        counter_increment("scheduler_stale_completions_total", labels='kind="effect"')
        raise StaleAttempt(f"attempt {attempt_number} of run {run_id} is stale")
