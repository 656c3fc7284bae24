"""API tokens: authentication's one lookup, by the key's digest (jobs.tokens)."""

from __future__ import annotations

import datetime as dt
import functools

from django.contrib.auth import get_user_model
from django.contrib.auth.base_user import AbstractBaseUser
from django.db import connection

from .sql import fetch_one


@functools.cache
def _owner_query() -> tuple[type[AbstractBaseUser], str, list[str], list[tuple[int, list]]]:
    """token_owner's statement: the user model, its SQL, the user's fields it reads, and
    the (position, converters) of those that convert database values (a custom user
    model's JSON field, say). Every API request authenticates: building the ORM's join,
    filters and instances each time cost about 2 ms of CPU a request (bench/profile_api.py
    --preview: 6.7 ms a request in one process before, 4.3 ms after), several times the
    database's work; the statement is the same every time."""
    user = get_user_model()
    quote = connection.ops.quote_name
    fields = user._meta.concrete_fields
    columns = ", ".join(f"u.{quote(field.column)}" for field in fields)
    sql = (
        f"SELECT {columns} FROM jobs_api_token AS t "
        f"JOIN {quote(user._meta.db_table)} AS u ON u.{quote(user._meta.pk.column)} = t.owner_id "
        "WHERE t.digest = %s AND t.revoked_at IS NULL "
        "AND (t.expires_at IS NULL OR t.expires_at > COALESCE(%s::timestamptz, clock_timestamp()))"
    )
    converters = [
        (index, found)
        for index, field in enumerate(fields)
        if (found := field.get_db_converters(connection))
    ]
    return user, sql, [field.attname for field in fields], converters


def token_owner(*, digest: str, now: dt.datetime | None = None) -> AbstractBaseUser | None:
    """The owner (an instance of the user model, active or not) of the token whose key's
    SHA-256 is `digest`, if that token is live at `now` (None: the database's clock, read
    in the statement, never a web process's own): not revoked, and its expiry (if any)
    after `now`. One indexed lookup (the digest is unique) joined to the user's row;
    reads in the caller's transaction (or autocommit) and takes no lock."""
    user, sql, fields, converters = _owner_query()
    row = fetch_one(sql, [digest, now], prepared=True)  # every API request
    if row is None:
        return None
    values = list(row)
    for index, field_converters in converters:
        for convert in field_converters:
            values[index] = convert(values[index], None, connection)
    return user.from_db(connection.alias, fields, values)
