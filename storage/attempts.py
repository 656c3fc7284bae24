"""Attempts: lease renewals and the batched success of attempts and their runs, and the
bounded lock wait of a transaction that ends attempts."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Sequence
from typing import NamedTuple

from django.db import connection

from .logs import MANIFEST_FIELDS, LogManifestRow, manifests_document
from .sql import execute, fetch_all, fetch_one, prepared_cursor


class LeaseRenewal(NamedTuple):
    """A running attempt's lease to extend: it holds `token`, for `seconds` from now."""

    attempt_id: int
    token: int
    seconds: float


class Renewal(NamedTuple):
    """The outcome of a renewal: the attempts whose lease was extended, and those whose row
    another transaction holds (a cancel, a completion or a reaper ending it, a frozen one
    included), neither renewed nor refused: the caller asks again shortly. An attempt in
    neither lost its lease or its token."""

    renewed: set[int]
    held_elsewhere: set[int]


_RENEW = """
    WITH clock AS (SELECT COALESCE(%(now)s::timestamptz, clock_timestamp()) AS now),
    wanted AS (
        SELECT * FROM unnest(%(ids)s::bigint[], %(tokens)s::bigint[], %(seconds)s::float8[])
                   AS l(id, token, seconds)
    ),
    free AS (
        SELECT id FROM jobs_attempt WHERE id = ANY(%(ids)s::bigint[])
           FOR NO KEY UPDATE SKIP LOCKED
    ),
    renewed AS (
        UPDATE jobs_attempt AS a
           SET heartbeat_at = clock.now,
               lease_expires_at = clock.now + make_interval(secs => l.seconds)
          FROM clock, wanted AS l, free
         WHERE a.id = l.id AND a.id = free.id AND a.state = 'running'
           AND a.fencing_token = l.token
     RETURNING a.id
    )
    SELECT (SELECT coalesce(array_agg(id), '{}') FROM renewed),
           (SELECT coalesce(array_agg(id), '{}') FROM jobs_attempt
             WHERE id = ANY(%(ids)s::bigint[]) AND id NOT IN (SELECT id FROM free))
"""


def attempts_renew_leases(
    *, leases: list[LeaseRenewal] | list[tuple[int, int, float]], now: dt.datetime | None = None
) -> Renewal:
    """Extend the leases of running attempts that still hold their token, in one
    statement; `now` defaults to the database's clock (clock_timestamp()).

    Never waits for a row lock: an attempt whose row another transaction holds is passed
    over (FOR NO KEY UPDATE SKIP LOCKED, the lock an UPDATE takes, so a foreign key's
    KEY SHARE is no obstacle) and reported held elsewhere, so one attempt a frozen reaper
    holds cannot keep the process's other leases from being renewed until they expire.

    Conditioned on the attempt row alone: every path that moves a run out of `running` ends
    its running attempt in the same transaction, and the attempt's own conditions are
    re-checked on its newest version (READ COMMITTED), so it never renews an attempt the
    reaper ended meanwhile. Runs in its own implicit transaction or the caller's; takes the
    row locks of the attempts it reached."""
    if not leases:
        return Renewal(renewed=set(), held_elsewhere=set())
    ids, tokens, seconds = (list(column) for column in zip(*leases, strict=True))
    renewed, held = fetch_one(_RENEW, {"now": now, "ids": ids, "tokens": tokens,
                                       "seconds": seconds})  # fmt: skip
    return Renewal(renewed=set(renewed), held_elsewhere=set(held))


class Success(NamedTuple):
    """An attempt to record succeeded: its run, the token it holds, the run's result (any
    JSON value; None stays SQL NULL) and, for a reserved attempt, its start as its worker
    saw it (None: the claim wrote it)."""

    attempt_id: int
    run_id: uuid.UUID
    token: int
    result: object
    started_at: dt.datetime | None


class Succeeded(NamedTuple):
    won: set[int]  # the ids of the attempts that moved to succeeded
    runs_moved: int  # their runs moved with them (equal to len(won) but for a hand edit)


# With `sealed` (storage.logs.manifests_document): the manifests of the attempts that won
# are inserted by the same statement, so their logs are complete whenever their runs show
# their success.
_SEAL = f"""
    sealed AS (
        INSERT INTO logs_app_logmanifest ({", ".join(MANIFEST_FIELDS)}, created_at)
        SELECT {", ".join(f"m.{field}" for field in MANIFEST_FIELDS)},
               COALESCE(m.created_at, NOW())
          FROM jsonb_populate_recordset(NULL::logs_app_logmanifest, %(manifests)s::jsonb) AS m
          JOIN finished AS f ON f.id = m.attempt_id
    ),"""

_SUCCEED = """
    WITH outcome AS (
        SELECT * FROM unnest(%(ids)s::bigint[], %(runs)s::uuid[], %(tokens)s::bigint[],
                             %(results)s::jsonb[], %(started)s::timestamptz[])
                   AS o(attempt_id, run_id, token, result, started)
    ),
    finished AS (
        UPDATE jobs_attempt AS a
           SET state = 'succeeded', error = '',
               finished_at = STATEMENT_TIMESTAMP(),
               started_at = COALESCE(a.started_at, o.started)
          FROM outcome AS o
         WHERE a.id = o.attempt_id AND a.state = 'running'
           AND a.fencing_token = o.token
           AND EXISTS (SELECT 1 FROM jobs_run AS r WHERE r.id = o.run_id
                       AND r.state = 'running' AND r.fencing_token = o.token)
     RETURNING a.id, a.run_id, o.token, o.result, a.started_at
    ),{sealed}
    moved AS (
        UPDATE jobs_run AS r
           SET state = 'succeeded', finished_at = STATEMENT_TIMESTAMP(),
               updated_at = STATEMENT_TIMESTAMP(), result = f.result, failure_reason = '',
               started_at = COALESCE(r.started_at, f.started_at)
          FROM finished AS f
         WHERE r.id = f.run_id AND r.state = 'running' AND r.fencing_token = f.token
     RETURNING r.id
    )
    SELECT (SELECT count(*) FROM moved), array_agg(id) FROM finished
"""
_SUCCEED_SEALED = _SUCCEED.format(sealed=_SEAL)
_SUCCEED = _SUCCEED.format(sealed="")


def attempts_succeed(
    *, successes: list[Success], manifests: Sequence[LogManifestRow] = ()
) -> Succeeded:
    """running -> succeeded for attempts and their runs, in one statement: each only while
    its attempt is running with its token and its run is running with the same token (the
    current one). Finished at the statement's time. Run inside the caller's transaction (a
    hand edit of a run between the two updates shows as `runs_moved < len(won)`, for the
    caller to roll back). Takes the attempts' row locks first, in id order and in a
    statement of their own, as every multi-run cancel takes them
    (jobs.transitions.runs_lock_to_cancel): in plan order, a pack and the materializer
    cancelling runs of several jobs deadlocked. The update's snapshot then comes after
    those locks, so it never waits on a run that has left `running` meanwhile (whose
    attempt it does not hold: a run leaves `running` only with its attempt's row lock).
    `manifests`: the attempts' log manifests, inserted by the same statement for those
    that won (none for a refused one)."""
    if not successes:
        return Succeeded(won=set(), runs_moved=0)
    if len(successes) > 1:
        fetch_all(
            "SELECT id FROM jobs_attempt WHERE id = ANY(%s) ORDER BY id FOR UPDATE",
            [[success.attempt_id for success in successes]],
        )
    with prepared_cursor() as cursor:  # the worker's hot statement: planned once
        cursor.execute(_SUCCEED_SEALED if manifests else _SUCCEED, {
            "ids": [success.attempt_id for success in successes],
            "runs": [success.run_id for success in successes],
            "tokens": [success.token for success in successes],
            # None stays SQL NULL, as the ORM stores it.
            "results": [
                None if success.result is None else json.dumps(success.result)
                for success in successes
            ],
            "started": [success.started_at for success in successes],
            "manifests": manifests_document(manifests) if manifests else None,
        })  # fmt: skip
        moved, won = cursor.fetchone()
    return Succeeded(won=set(won or ()), runs_moved=moved)


def lock_timeout_set_local(*, seconds: float) -> None:
    """Bound how long the rest of the caller's transaction waits for any lock (SET LOCAL
    lock_timeout, in milliseconds): past it the waiting statement fails with
    OperationalError (lock_not_available) instead of queueing behind the holder. Must run
    inside a transaction block; takes no lock."""
    if not connection.in_atomic_block:
        raise RuntimeError("lock_timeout_set_local needs a transaction block")
    execute(f"SET LOCAL lock_timeout = '{int(seconds * 1000)}ms'")
