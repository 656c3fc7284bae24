"""Idempotency keys: the same request sent twice with one key has one effect and one answer.

The record is inserted first (`INSERT ... ON CONFLICT DO NOTHING`), in the transaction of
the operation it guards: a concurrent duplicate blocks on `idempotency_key_unique` until
the first commits, then reads its answer (or, if the first rolled back, becomes the first
itself). Work that locks nothing (a job's creation) is done first and its record inserted
with its answer, in one statement; a duplicate then rolls its work back and is answered
the same way. `POST /jobs/bulk/` claims all its
items' keys first, in one statement. Only successful answers are kept: an error writes
nothing, so the client may fix its body and retry with the key.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import logging
from collections.abc import Callable

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction

from storage.idempotency import (
    idempotency_record_insert_answered,
    idempotency_records_answer,
    idempotency_records_insert_pending,
)

from .models import IdempotencyRecord

log = logging.getLogger("jobs.idempotency")

# How long a key answers with its first result; older records are pruned and forgotten.
IDEMPOTENCY_RETENTION = dt.timedelta(hours=24)
MAX_KEY_LENGTH = 200


@dataclasses.dataclass(frozen=True)
class Answer:
    status: int
    body: dict | list
    replayed: bool = False


class _Undone(Exception):
    """Rolls back an answer that its key's record did not take."""


class IdempotencyConflict(Exception):
    """The key was used before, by this owner on this operation, with another body."""


def idempotency_key_problem(key: str) -> str | None:
    if not key or len(key) > MAX_KEY_LENGTH or not key.isprintable():
        return f"Must be 1-{MAX_KEY_LENGTH} printable characters."
    return None


def request_hash(body) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def idempotent_answer(
    *,
    owner: AbstractBaseUser,
    scope: str,
    key: str | None,
    body,
    now: dt.datetime,
    produce: Callable[[], Answer],
    lockless: bool = False,
) -> Answer:
    """`produce()` once per (owner, scope, key); its first successful answer is replayed to
    every repeat with the same body. Raises IdempotencyConflict for another body.

    `lockless`: `produce()` takes no lock another transaction may wait for (it only inserts
    new rows, as a job's creation does), so its work may be done before its key is taken
    (one statement fewer). Work that locks rows (a trigger locks its job) claims the key
    first: done the other way round, a retry racing its own original could deadlock."""
    if key is None:
        return produce()
    digest = request_hash(body)
    if lockless:
        try:
            with transaction.atomic():
                # The answer first, then its record with it in one statement: a key seen
                # for the first time (nearly every request) costs one statement. A key held
                # or used before makes this insert wait for its holder or find its record;
                # the work is then rolled back and done the careful way below, as is any
                # work that did not succeed: its answer may be the key's earlier one.
                answer = produce()
                if 200 <= answer.status < 300 and idempotency_record_insert_answered(
                    owner_id=owner.pk,
                    scope=scope,
                    key=key,
                    request_hash=digest,
                    status=answer.status,
                    body=answer.body,
                    now=now,
                ):
                    return answer
                raise _Undone
        except _Undone:
            pass
        except Exception:  # rolled back; produced again below, where errors are the answer
            log.debug("idempotent %s: first try failed; claiming the key first", scope,
                      exc_info=True)  # fmt: skip
    with transaction.atomic():
        earlier = idempotency_claim(owner=owner, scope=scope, digests={key: digest}, now=now)
        if key in earlier:
            if earlier[key].request_hash != digest:
                raise IdempotencyConflict(
                    f"Idempotency-Key '{key}' was already used with another request body."
                )
            return Answer(earlier[key].response_status, earlier[key].response_body, replayed=True)
        answer = produce()
        if 200 <= answer.status < 300:
            IdempotencyRecord.objects.filter(owner=owner, scope=scope, key=key).update(
                response_status=answer.status, response_body=answer.body
            )
        else:
            transaction.set_rollback(True)
        return answer


def idempotency_claim(
    *, owner: AbstractBaseUser, scope: str, digests: dict[str, str], now: dt.datetime
) -> dict[str, IdempotencyRecord]:
    """Insert a pending record for each key (`digests`: key -> request hash) inside the
    caller's transaction, one statement for all; returns the live earlier record of every
    key that another request holds. A key held by a transaction still open waits for it
    (`ON CONFLICT` on `idempotency_key_unique`); an expired holder is deleted and the key
    taken. Keys are inserted in sorted order, so two requests sharing keys cannot deadlock.
    The caller fills the records it got with `idempotency_store`."""
    pending, earlier = sorted(digests), {}
    if not pending:
        return earlier
    for _ in range(2):  # a second try only after removing expired holders
        taken = idempotency_records_insert_pending(
            owner_id=owner.pk,
            scope=scope,
            pending=[(key, digests[key]) for key in pending],
            now=now,
        )
        held = [key for key in pending if key not in taken]
        if not held:
            return earlier
        expired = []
        for record in IdempotencyRecord.objects.filter(owner=owner, scope=scope, key__in=held):
            if record.created_at >= now - IDEMPOTENCY_RETENTION:
                earlier[record.key] = record
            else:
                expired.append(record.id)
        IdempotencyRecord.objects.filter(id__in=expired).delete()
        # Expired ones, and any pruned between the insert and the select, are tried again.
        pending = [key for key in held if key not in earlier]
        if not pending:
            return earlier
    raise IdempotencyConflict(f"Idempotency-Key '{pending[0]}' is being used concurrently.")


def idempotency_store(
    *, owner: AbstractBaseUser, scope: str, status: int, bodies: dict[str, dict | list]
) -> None:
    """Fill the records `idempotency_claim` took with their answers, one statement."""
    if not bodies:
        return
    idempotency_records_answer(owner_id=owner.pk, scope=scope, status=status, bodies=bodies)


def idempotency_prune(*, now: dt.datetime, limit: int = 1000) -> int:
    """Delete up to `limit` records past their retention; returns how many."""
    expired = IdempotencyRecord.objects.filter(
        created_at__lt=now - IDEMPOTENCY_RETENTION
    ).values_list("id", flat=True)[:limit]
    deleted, _ = IdempotencyRecord.objects.filter(id__in=list(expired)).delete()
    return deleted
