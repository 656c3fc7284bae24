"""Idempotency keys: the same request sent twice with one key has one effect and one answer.

The record is inserted first, in the transaction of the operation it guards: a concurrent
duplicate blocks on `idempotency_key_unique` until the first commits, then reads its
answer (or, if the first rolled back, becomes the first itself). Only successful answers
are kept: an error writes nothing, so the client may fix its body and retry with the key.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
from collections.abc import Callable

from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction

from .models import IdempotencyRecord

# How long a key answers with its first result; older records are pruned and forgotten.
IDEMPOTENCY_RETENTION = dt.timedelta(hours=24)
MAX_KEY_LENGTH = 200


@dataclasses.dataclass(frozen=True)
class Answer:
    status: int
    body: dict | list
    replayed: bool = False


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
) -> Answer:
    """`produce()` once per (owner, scope, key); its first successful answer is replayed to
    every repeat with the same body. Raises IdempotencyConflict for another body."""
    if key is None:
        return produce()
    digest = request_hash(body)
    with transaction.atomic():
        record = IdempotencyRecord(
            owner=owner,
            scope=scope,
            key=key,
            request_hash=digest,
            response_status=0,
            response_body={},
            created_at=now,
        )
        earlier = _insert_or_earlier(record, now=now)
        if earlier is not None:
            if earlier.request_hash != digest:
                raise IdempotencyConflict(
                    f"Idempotency-Key '{key}' was already used with another request body."
                )
            return Answer(earlier.response_status, earlier.response_body, replayed=True)
        answer = produce()
        if 200 <= answer.status < 300:
            IdempotencyRecord.objects.filter(id=record.id).update(
                response_status=answer.status, response_body=answer.body
            )
        else:
            transaction.set_rollback(True)
        return answer


def _insert_or_earlier(record: IdempotencyRecord, *, now: dt.datetime):
    """Insert `record` and return None, or return the live record that holds its key."""
    for _ in range(2):  # a second try only after removing an expired holder
        try:
            with transaction.atomic():
                record.save(force_insert=True)
            return None
        except IntegrityError:
            earlier = IdempotencyRecord.objects.filter(
                owner=record.owner, scope=record.scope, key=record.key
            ).first()
            if earlier is None:
                continue  # pruned meanwhile
            if earlier.created_at >= now - IDEMPOTENCY_RETENTION:
                return earlier
            IdempotencyRecord.objects.filter(id=earlier.id).delete()
    raise IdempotencyConflict(f"Idempotency-Key '{record.key}' is being used concurrently.")


def idempotency_prune(*, now: dt.datetime, limit: int = 1000) -> int:
    """Delete up to `limit` records past their retention; returns how many."""
    expired = IdempotencyRecord.objects.filter(
        created_at__lt=now - IDEMPOTENCY_RETENTION
    ).values_list("id", flat=True)[:limit]
    deleted, _ = IdempotencyRecord.objects.filter(id__in=list(expired)).delete()
    return deleted
