"""Packed deliveries: the runs of one message, one after another, the first attempts of
`at_least_once` runs reserved together and started at their turn."""

from __future__ import annotations

import datetime as dt
import logging
import time
import uuid
from collections.abc import Callable

from django.db import DatabaseError, InterfaceError, OperationalError, connection

from jobs.models import Attempt, AttemptState
from jobs.services import attempt_release_unstarted
from jobs.transitions import attempts_still_running, runs_reserve
from storage.queues import runs_of_held_queues

from .delivery import attempt_execute, published_at_of, run_execute_delivery
from .keeper import LEASE_KEEPER, Lease
from .limits import PACK_RUN_GRACE_SECONDS, enforces_time_limits
from .outage import adopting, with_database_retries
from .recording import Successes

log = logging.getLogger("dispatch.worker")
# A reserved run is looked at again before it starts unless its pack looked this recently.
RESERVED_CHECK_SECONDS = 0.02


class PackInterrupted(Exception):
    """A run of a packed message ended the task (a BaseException from its handler, or a
    failure to record its outcome): the runs after it must be delivered again."""

    def __init__(self, remaining: list[str]) -> None:
        super().__init__(f"{len(remaining)} runs of the pack not reached")
        self.remaining = remaining


def run_execute_deliveries(
    *,
    run_ids: list[str],
    handler: Callable,
    worker: str,
    message_id: str,
    published_at: str | None = None,
    time_limit: float | None = None,
) -> dict:
    """The runs of one message (the relay packs short runs of one task), one after another,
    each with its own attempt, lease, token and time limit.

    The first attempts of `at_least_once` runs are reserved together, in one statement
    (`runs_reserve`): `running`, with a lease the process's keeper renews, but not started
    until their turn. Before its turn a reserved run is looked at again (`Pack`): one that
    was cancelled, or taken by the reaper, meanwhile is not started. Every other run (a
    retry, a replay, `at_most_once`, a duplicate delivery) is claimed when its turn comes
    (`run_execute_delivery`). Successes are recorded together (`Successes`); a reserved
    run's start is recorded with its outcome.

    Reserved runs go first, in the order of their attempts, then the others. Outcome
    `claim_failed` carries the unreserved runs still to deliver (`remaining`); anything else
    that stops the pack releases the reserved runs not reached (`attempt_release`: back to
    their queue through the outbox, their attempt not charged) and raises PackInterrupted
    (from its cause) with the unreserved runs not reached."""
    try:
        # Only where the worker enforces each run's time limit itself (SIGALRM, in a pool
        # process's main thread): a reserved attempt's deadline is only the latest its pack
        # lets it end, too loose to be its limit.
        # Runs of a paused or capped queue go one by one, through the claim's gate
        # (dispatch.queues), never reserved ahead of their turn.
        held = set(runs_of_held_queues(run_ids=run_ids))
        reserved = (
            _reserve(
                run_ids=[run_id for run_id in run_ids if run_id not in held],
                worker=worker,
                published_at=published_at_of(published_at),
                task_id=message_id,
            )  # fmt: skip
            if enforces_time_limits()
            else []
        )
    except (OperationalError, InterfaceError):
        log.error("could not claim the %d runs of a pack: the database is away", len(run_ids))
        return {"outcome": "claim_failed", "remaining": list(run_ids), "runs": []}
    pack = Pack(reserved)
    order = [str(attempt.run_id) for attempt in reserved]
    order += [run_id for run_id in run_ids if run_id not in pack.by_run]
    successes = Successes()
    summaries: list[dict] = []
    try:
        for index, run_id in enumerate(order):
            if run_id not in pack.by_run and not _written_before_claim(successes):
                remaining = pack.hand_back(order[index:])
                return {"outcome": "claim_failed", "remaining": remaining, "runs": summaries}
            try:
                if run_id in pack.by_run:
                    summary = pack.run(run_id, handler=handler, worker=worker,
                                       time_limit=time_limit, successes=successes)  # fmt: skip
                else:
                    summary = run_execute_delivery(
                        run_id=run_id, handler=handler, worker=worker, message_id=message_id,
                        published_at=published_at, time_limit=time_limit, successes=successes,
                    )  # fmt: skip
            except BaseException as exc:  # noqa: BLE001 - the rest of the pack must not be lost
                # This run's own attempt, if claimed, is recorded or left to its lease.
                remaining = pack.hand_back(order[index + 1 :])
                if not remaining:
                    raise
                raise PackInterrupted(remaining) from exc
            if summary["outcome"] == "claim_failed":
                remaining = pack.hand_back(order[index:])
                return {"outcome": "claim_failed", "remaining": remaining, "runs": summaries}
            summaries.append(summary)
    finally:
        try:
            successes.write()
        except DatabaseError:
            # The database stayed away past the retries: the successes' leases lapse and
            # the reaper retries them; this does not replace what ends the pack.
            log.error("could not record the successes of a pack; their leases will lapse")
        finally:
            LEASE_KEEPER.unwatch(successes)
    for summary in summaries:
        if summary["outcome"] == "recording":
            summary["outcome"] = successes.outcomes[summary.pop("attempt_id")]
    position = {run_id: index for index, run_id in enumerate(run_ids)}
    summaries.sort(key=lambda summary: position.get(summary["run_id"], 0))  # as delivered
    return {"outcome": "done", "runs": summaries}


def _written_before_claim(successes: Successes) -> bool:
    """Write the pack's pending successes before a run is claimed at its turn: it may be a
    retry of one that kills its process, and must not take its pack-mates' outcomes with
    it. False when the database stayed away (the caller delivers the rest again)."""
    try:
        successes.write()
    except DatabaseError:
        log.error("could not record a pack's successes before a claim: the database is away")
        return False
    return True


def _reserve(
    *, run_ids: list[str], worker: str, published_at: dt.datetime | None, task_id: str
) -> list[Attempt]:
    """`runs_reserve`, retrying through a database outage for a bounded time; a retry
    after an ambiguous commit adopts the attempts the first try may have made."""

    def reserve(claim_id: uuid.UUID) -> list[Attempt]:
        return runs_reserve(run_ids=run_ids, worker=worker, claim_id=claim_id,
                            published_at=published_at, task_id=task_id,
                            grace_seconds=PACK_RUN_GRACE_SECONDS)  # fmt: skip

    return adopting(reserve, _adopt_reserved)


def _adopt_reserved(claim_id: uuid.UUID) -> list[Attempt]:
    attempts = list(
        Attempt.objects.select_related("run__job_version")
        .filter(claim_id=claim_id, state=AttemptState.RUNNING, started_at__isnull=True)
        .order_by("id")
    )
    for attempt in attempts:
        attempt.reserved_at = attempt.heartbeat_at
    return attempts


class Pack:
    """A packed message's reserved attempts: each held by the process's lease keeper from
    the reservation on, started at its turn unless it was ended meanwhile."""

    def __init__(self, reserved: list[Attempt]) -> None:
        self.by_run = {str(attempt.run_id): attempt for attempt in reserved}
        self.leases = {
            str(attempt.run_id): LEASE_KEEPER.hold(
                attempt, attempt.run.job_version.spec["heartbeat_timeout_seconds"]
            )
            for attempt in reserved
        }
        self._reserved_at = time.monotonic()
        self._checked_at = self._reserved_at
        self._waiting = set(self.by_run)

    def _started_at(self, attempt: Attempt) -> dt.datetime:
        """Now, on the database's clock: its time at the reservation plus the time since."""
        return attempt.reserved_at + dt.timedelta(seconds=time.monotonic() - self._reserved_at)

    def _ended_meanwhile(self, attempt: Attempt, lease: Lease) -> bool:
        if lease.lost.is_set():
            return True
        if time.monotonic() - self._checked_at < RESERVED_CHECK_SECONDS:
            return False
        waiting = [self.by_run[run_id].id for run_id in self._waiting]
        running = with_database_retries(lambda: attempts_still_running(attempt_ids=waiting))
        self._checked_at = time.monotonic()
        for run_id in list(self._waiting):
            if self.by_run[run_id].id not in running:
                self.leases[run_id].lost.set()
        return lease.lost.is_set()

    def run(
        self,
        run_id: str,
        *,
        handler: Callable,
        worker: str,
        time_limit: float | None,
        successes: Successes,
    ) -> dict:
        attempt, lease = self.by_run[run_id], self.leases[run_id]
        try:
            ended_meanwhile = self._ended_meanwhile(attempt, lease)
            self._waiting.discard(run_id)
            if ended_meanwhile:
                LEASE_KEEPER.release(lease)
                state = Attempt.objects.filter(id=attempt.id).values_list("state", flat=True)
                ended = state.first()
                log.info("reserved run %s ended (%s) before its turn; not started", run_id, ended)
                outcome = "cancelled" if ended == AttemptState.CANCELLED else "lost"
                return {"run_id": run_id, "attempt": attempt.number, "outcome": outcome}
            attempt.started_at = self._started_at(attempt)
            return attempt_execute(attempt, lease, handler=handler, worker=worker,
                            time_limit=time_limit, successes=successes)  # fmt: skip
        except BaseException:
            LEASE_KEEPER.release(lease)
            if attempt.started_at is None:  # it failed before its start: never ran
                self.release([run_id])
            raise

    def hand_back(self, run_ids: list[str]) -> list[str]:
        """The runs of `run_ids` not started here: the reserved ones are released, the
        others returned, to be delivered again."""
        self.release(run_ids)
        return [run_id for run_id in run_ids if run_id not in self.by_run]

    def release(self, run_ids: list[str]) -> None:
        """The reserved runs among `run_ids` never start here: their attempts end unstarted
        and uncharged, their runs go back to their queue through the outbox. Through a
        database outage their leases lapse instead, and the reaper releases them."""
        for run_id in run_ids:
            if run_id not in self.by_run:
                continue
            self._waiting.discard(run_id)
            attempt, lease = self.by_run[run_id], self.leases[run_id]
            LEASE_KEEPER.release(lease)
            try:
                attempt_release_unstarted(attempt=attempt, by=f"worker:{attempt.worker}",
                                          error="its pack ended before its turn")  # fmt: skip
            except DatabaseError:
                log.warning("could not release reserved run %s; its lease will lapse", run_id)
                connection.close()
