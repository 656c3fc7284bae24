"""Idempotency keys' records (jobs.idempotency): a key is taken by inserting its record,
in the transaction of the work it guards; `idempotency_key_unique` (owner, scope, key)
makes a concurrent duplicate wait for that transaction, then find the record or, if it
rolled back, take the key itself."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping, Sequence

from .sql import execute, fetch_all, fetch_one

_COLUMNS = 'owner_id, scope, "key", request_hash, response_status, response_body, created_at'


def idempotency_records_insert_pending(
    *, owner_id: int, scope: str, pending: Sequence[tuple[str, str]], now: dt.datetime
) -> set[str]:
    """Insert a record without its answer (status 0, body `{}`) for each (key, request
    hash) of `pending`, in the order given, one statement for any number of keys (one JSON
    array parameter); the keys it inserted. A key whose record exists is skipped (`ON
    CONFLICT DO NOTHING`, no savepoint); one whose record another open transaction inserted
    waits for that transaction to end. Runs in the caller's transaction, which holds the
    inserted rows' key until it ends: callers pass sorted keys, so that two requests
    sharing keys take them in one order and cannot deadlock."""
    rows = json.dumps([{"k": key, "h": digest} for key, digest in pending])
    found = fetch_all(
        f"INSERT INTO jobs_idempotencyrecord ({_COLUMNS}) "
        "SELECT %s, %s, v.k, v.h, 0, '{}', %s "
        "FROM jsonb_to_recordset(%s::jsonb) AS v(k text, h text) "
        'WHERE true ON CONFLICT DO NOTHING RETURNING "key"',
        [owner_id, scope, now, rows],
    )
    return {key for (key,) in found}


def idempotency_record_insert_answered(
    *,
    owner_id: int,
    scope: str,
    key: str,
    request_hash: str,
    status: int,
    body: dict | list,
    now: dt.datetime,
) -> bool:
    """Insert the record of `key` with its answer, unless the key has a record: whether it
    inserted it. A record another open transaction inserted makes this wait for that
    transaction to end (then: False if it committed). Runs in the caller's transaction."""
    return (
        fetch_one(
            f"INSERT INTO jobs_idempotencyrecord ({_COLUMNS}) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING RETURNING 1",
            [owner_id, scope, key, request_hash, status, json.dumps(body), now],
            prepared=True,  # every keyed creation
        )
        is not None
    )


def idempotency_records_answer(
    *, owner_id: int, scope: str, status: int, bodies: Mapping[str, dict | list]
) -> int:
    """Fill the records of the keys of `bodies` (key -> answer body), which the caller's
    transaction inserted with idempotency_records_insert_pending, with their answers: one
    statement; how many records it updated. Row locks: those records, which the caller's
    transaction holds already."""
    rows = json.dumps([{"k": key, "body": body} for key, body in bodies.items()])
    return execute(
        "UPDATE jobs_idempotencyrecord SET response_status = %s, response_body = v.body "
        "FROM jsonb_to_recordset(%s::jsonb) AS v(k text, body jsonb) "
        "WHERE jobs_idempotencyrecord.owner_id = %s AND jobs_idempotencyrecord.scope = %s "
        'AND jobs_idempotencyrecord."key" = v.k',
        [status, rows, owner_id, scope],
    )
