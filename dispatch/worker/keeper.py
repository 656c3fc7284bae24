"""The process's lease keeper: one thread renews the leases of every attempt the process
runs, in one statement, and writes a pack's successes that waited long enough.

The renewal waits for no row lock: an attempt whose row another transaction holds (a
cancel or a reaper ending it; a reaper frozen there holds it for as long as its session
lasts) is passed over and asked again shortly, so it never keeps the process's other
leases from being renewed. A heartbeat says True only for a renewal that committed."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING

from django.db import DatabaseError, connection

from jobs.counters import counter_increment
from jobs.models import Attempt, AttemptState
from jobs.transitions import attempts_renew_leases

if TYPE_CHECKING:
    from .recording import Successes

log = logging.getLogger("dispatch.worker")
# A renewal that failed, or found its attempt's row held elsewhere, is tried again this soon.
RETRY_SECONDS = 0.5


class Lease:
    """One attempt's lease, renewed by its process's LeaseKeeper while the handler runs."""

    def __init__(self, attempt: Attempt, lease_seconds: float) -> None:
        self.attempt = attempt
        self.lease_seconds = lease_seconds
        self.interval = max(0.5, lease_seconds / 3)
        self.renew_at = time.monotonic() + self.interval
        self.lost = threading.Event()
        # Set while the attempt's own outcome is written: a refusal that finds that outcome
        # recorded is not staleness.
        self.finishing = False
        self._renewed = threading.Condition()
        # When (monotonic) a renewal last committed, and last failed (the database away).
        self.renewed_at = 0.0
        self.failed_at = 0.0

    @property
    def key(self) -> tuple[int, int, float]:
        return (self.attempt.id, self.attempt.fencing_token, self.lease_seconds)

    def renew(self) -> bool:
        """One renewal of this lease alone, from the calling thread; True when it committed
        (False: lost, its row held by another transaction, or the database away)."""
        try:
            renewal = attempts_renew_leases(leases=[self.key])
        except DatabaseError:
            log.warning("lease renewal failed", exc_info=True)
            connection.close()
            self.failed()
            return False
        if self.attempt.id not in renewal.held_elsewhere:
            self.settle(self.attempt.id in renewal.renewed)
        return self.attempt.id in renewal.renewed and not self.lost.is_set()

    def settle(self, renewed: bool) -> None:
        """The outcome of a renewal: a refusal loses the lease, counted unless a cancel or
        the attempt's own outcome explains it."""
        if not renewed and not self.lost.is_set():
            self.lost.set()
            state = self._attempt_state()
            if state == AttemptState.CANCELLED:
                log.info("run %s was cancelled; the handler is asked to stop", self.attempt.run_id)
            elif self.finishing and state in (AttemptState.SUCCEEDED, AttemptState.FAILED):
                pass  # the attempt's own outcome just landed
            elif self.attempt.started_at is None:
                pass  # reserved, and ended before its turn: it never ran here
            else:
                counter_increment("scheduler_stale_completions_total", labels='kind="heartbeat"')
        with self._renewed:
            if renewed:
                self.renewed_at = time.monotonic()
            self._renewed.notify_all()

    def failed(self) -> None:
        """A renewal failed (the database away): a waiting heartbeat returns False."""
        with self._renewed:
            self.failed_at = time.monotonic()
            self._renewed.notify_all()

    def _attempt_state(self) -> str | None:
        try:
            return (
                Attempt.objects.filter(id=self.attempt.id).values_list("state", flat=True).first()
            )
        except DatabaseError:
            return None


class LeaseKeeper:
    """One thread per worker process renews the leases of every attempt the process runs,
    all in one statement, each on its own schedule (a third of its lease). A run shorter
    than that costs the keeper nothing; a heartbeat asks for a renewal now and waits for it.
    The thread starts with the first lease a process holds (after Celery's fork)."""

    def __init__(self) -> None:
        self._leases: dict[int, Lease] = {}
        self._lock = threading.Lock()
        self._poke = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self.failing = False  # renewals fail (the database is away): retry every half second
        self._batches: set[Successes] = set()

    def hold(self, attempt: Attempt, lease_seconds: float) -> Lease:
        lease = Lease(attempt, lease_seconds)
        with self._lock:
            self._leases[attempt.id] = lease
            if self._thread is None or not self._thread.is_alive() or self._pid != os.getpid():
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
                self._thread.start()
        return lease

    def release(self, lease: Lease) -> None:
        with self._lock:
            if self._leases.get(lease.attempt.id) is lease:
                del self._leases[lease.attempt.id]
            idle = not self._leases
        if idle:
            self._poke.set()  # the keeper lets its connection go while it holds nothing

    def held(self) -> list[Lease]:
        with self._lock:
            return list(self._leases.values())

    def watch(self, batch: Successes) -> None:
        """Write `batch`'s successes once the oldest waited SUCCESS_BATCH_SECONDS, should the
        worker's thread still be busy with a later run of the pack."""
        with self._lock:
            self._batches.add(batch)
        self._poke.set()

    def unwatch(self, batch: Successes) -> None:
        with self._lock:
            self._batches.discard(batch)

    def renew_now(self, lease: Lease) -> bool:
        """A renewal made by the keeper's thread, on its own connection, waited for: a
        handler's heartbeat never writes inside the handler's own transaction (an open
        `ctx.effect` block would hold it back, and a failure would break that block).
        True only when a renewal committed since the call. False when the lease is lost
        (`lease.lost` is set), the database did not answer, or the attempt's row stayed
        held by another transaction (a frozen reaper ending it) for the whole wait."""
        if lease.lost.is_set():
            return False
        asked = time.monotonic()

        def answered() -> bool:
            return lease.lost.is_set() or max(lease.renewed_at, lease.failed_at) >= asked

        with lease._renewed:
            lease.renew_at = 0.0
            self._poke.set()
            lease._renewed.wait_for(answered, timeout=max(lease.interval, 5.0))
            return lease.renewed_at >= asked and not lease.lost.is_set()

    def _run(self) -> None:
        try:
            while True:
                try:
                    self._step()
                except Exception:  # noqa: BLE001 - the keeper must outlive any one failure
                    log.exception("lease keeper step failed; retrying")
                    connection.close()
                    time.sleep(0.5)
        finally:
            connection.close()

    def _step(self) -> None:
        """Renew the leases due and write the successes that waited long enough, or sleep
        until the next is due (or a heartbeat or a new success pokes)."""
        leases = self.held()
        with self._lock:
            batches = list(self._batches)
        now = time.monotonic()
        due = [lease for lease in leases if lease.renew_at <= now]
        if due:
            self._renew(due)
            return
        waited = [batch for batch in batches if batch.write_at() <= now]
        if waited:
            for batch in waited:
                batch.write(retry=False)
            return
        if not leases and connection.connection is not None:
            # Only runs longer than a third of their lease ever renew: most never do, and
            # an idle process holds no connection for them.
            connection.close()
        wake = min(
            [lease.renew_at for lease in leases] + [batch.write_at() for batch in batches],
            default=now + 1.0,
        )
        self._poke.wait(min(wake - now, 0.5 if self.failing else 1.0))
        self._poke.clear()

    def _renew(self, due: list[Lease]) -> None:
        try:
            renewal = attempts_renew_leases(leases=[lease.key for lease in due])
        except DatabaseError:
            log.warning("lease renewal failed; retrying", exc_info=True)
            connection.close()
            self.failing = True
            for lease in due:
                lease.renew_at = time.monotonic() + RETRY_SECONDS
                lease.failed()  # a waiting heartbeat returns, not renewed
            return
        self.failing = False
        for lease in due:
            if lease.attempt.id in renewal.held_elsewhere:
                # Neither renewed nor refused: asked again shortly, while the others' go on.
                lease.renew_at = time.monotonic() + RETRY_SECONDS
                continue
            lease.renew_at = time.monotonic() + lease.interval
            lease.settle(lease.attempt.id in renewal.renewed)
            if lease.lost.is_set():
                self.release(lease)


# The process's keeper (each Celery pool process has its own, after the fork).
LEASE_KEEPER = LeaseKeeper()
