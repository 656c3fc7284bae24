"""API tokens, hashed at rest (SPEC, "Security"): `Authorization: Token <key>` as DRF's
tokens were, several per user, with expiry and revocation.

A key is 40 random hex characters (160 bits), shown once, when it is created. The database
keeps its SHA-256 (unique, indexed: authentication is one indexed lookup) and its first 8
characters, for telling tokens apart. A salted, stretched password hash (Django's hashers)
would cost each request tens of milliseconds and could not be looked up by index; stretching
defends guessable secrets, and a 160-bit random key is not guessable.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import secrets

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import connection
from django.db.models import Q
from django.utils import timezone
from rest_framework import authentication, exceptions

from .models import ApiToken

PREFIX_CHARS = 8


def token_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def token_create(
    *,
    owner: AbstractBaseUser,
    now: dt.datetime,
    name: str = "",
    ttl: dt.timedelta | None = None,
) -> tuple[ApiToken, str]:
    """A new token of `owner` and its key (the only time the key exists in clear). `ttl`:
    its lifetime (default SCHEDULER_TOKEN_TTL_DAYS; 0 days: no expiry)."""
    if ttl is None and settings.SCHEDULER_TOKEN_TTL_DAYS:
        ttl = dt.timedelta(days=settings.SCHEDULER_TOKEN_TTL_DAYS)
    key = secrets.token_hex(20)
    token = ApiToken.objects.create(
        owner=owner,
        name=name,
        prefix=key[:PREFIX_CHARS],
        digest=token_digest(key),
        created_at=now,
        expires_at=now + ttl if ttl else None,
    )
    return token, key


def tokens_revoke(*, tokens, now: dt.datetime) -> int:
    """Revoke the tokens of the queryset `tokens` not revoked yet; how many it revoked."""
    return tokens.filter(revoked_at=None).update(revoked_at=now)


@functools.cache
def _owner_query() -> tuple[type, str, list[str], list[tuple[int, list]]]:
    """token_user's lookup on PostgreSQL: the owner's model, its SQL, the owner's fields it
    reads, and the (position, converters) of those that convert database values (a custom
    user model's JSON field, say). Every API request authenticates: building the ORM's join, filters
    and instances each time cost about 2 ms of CPU a request (bench/profile_api.py
    --preview: 6.7 ms a request in one process before, 4.3 ms after), several times the
    database's work; the statement is the same every time."""
    owner = ApiToken._meta.get_field("owner")
    user = owner.related_model
    quote = connection.ops.quote_name
    fields = user._meta.concrete_fields
    columns = ", ".join(f"u.{quote(field.column)}" for field in fields)
    sql = (
        f"SELECT {columns} FROM {quote(ApiToken._meta.db_table)} AS t "
        f"JOIN {quote(user._meta.db_table)} AS u "
        f"ON u.{quote(owner.target_field.column)} = t.{quote(owner.column)} "
        "WHERE t.digest = %s AND t.revoked_at IS NULL "
        "AND (t.expires_at IS NULL OR t.expires_at > %s)"
    )
    converters = [
        (index, found)
        for index, field in enumerate(fields)
        if (found := field.get_db_converters(connection))
    ]
    return user, sql, [field.attname for field in fields], converters


def token_user(*, key: str, now: dt.datetime) -> AbstractBaseUser | None:
    """The active user whose live (unrevoked, unexpired) token `key` is, else None."""
    if connection.vendor != "postgresql":
        # Embedded defaults: SQLite's raw values need the ORM's converters (datetimes).
        token = (
            ApiToken.objects.select_related("owner")
            .filter(digest=token_digest(key), revoked_at=None)
            .filter(Q(expires_at=None) | Q(expires_at__gt=now))
            .first()
        )
        return token.owner if token is not None and token.owner.is_active else None
    user, sql, fields, converters = _owner_query()
    with connection.cursor() as cursor:
        cursor.execute(sql, [token_digest(key), now])
        row = cursor.fetchone()
    if row is None:
        return None
    values = list(row)
    for index, field_converters in converters:
        for convert in field_converters:
            values[index] = convert(values[index], None, connection)
    owner = user.from_db(connection.alias, fields, values)
    return owner if owner.is_active else None


class TokenAuthentication(authentication.TokenAuthentication):
    """DRF's `Authorization: Token <key>` header, checked against the hashed tokens."""

    def authenticate_credentials(self, key):
        user = token_user(key=key, now=timezone.now())
        if user is None:
            raise exceptions.AuthenticationFailed("Invalid, expired or revoked token.")
        return user, None
