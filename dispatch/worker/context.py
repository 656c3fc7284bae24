"""What a handler receives as `ctx`: the run's identity, its heartbeat, whether it should
stop, and the fenced effect ledger."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging

from jobs.effects import EffectRecord, effect_once
from jobs.models import Attempt

from .keeper import LEASE_KEEPER, Lease


@dataclasses.dataclass
class RunContext:
    """What a handler receives as `ctx`."""

    run_id: str
    job_id: str
    attempt: int
    idempotency_key: str
    fencing_token: int
    scheduled_for: dt.datetime
    payload_ref: str | None
    logger: logging.LoggerAdapter
    _attempt: Attempt
    _lease: Lease

    def heartbeat(self) -> bool:
        """Renew the lease now; True once renewed. False: not renewed, either lost (this
        attempt may no longer own the run: `cancel_requested` is then True) or not
        confirmed in time (the database away, or the attempt's row held elsewhere)."""
        return LEASE_KEEPER.renew_now(self._lease)

    @property
    def cancel_requested(self) -> bool:
        """True once the handler should stop: the run was cancelled, or this attempt lost
        its lease (another attempt may own the run now). Seen at the next heartbeat."""
        return self._lease.lost.is_set()

    def effect(self, name: str) -> contextlib.AbstractContextManager[EffectRecord]:
        """Record an effect once per run, in a transaction fenced by this attempt's token
        (`jobs.effects.effect_once`): database writes made inside the block commit with the
        ledger row, and only if this attempt is still current; `record.done` tells a later
        execution of the same run that the effect was already committed."""
        return effect_once(run_id=self.run_id, name=name, attempt_number=self.attempt,
                           fencing_token=self.fencing_token)  # fmt: skip
