"""Many rows of one model in one INSERT, cheaply in Python.

Django's bulk_create on PostgreSQL sends each column as an array (`UNNEST`), and psycopg
writes an array literal of JSON values by escaping every quote of every value with a
regular expression: for 1,000 job specs that cost more than the database's work. Here the
rows go as one JSON document that `jsonb_populate_recordset` unpacks server-side; json
encodes it in C. Elsewhere (SQLite) this is bulk_create.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid

from django.db import connection, models


def _plain(value):
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not a column value rows_insert knows")


def rows_insert(objs: list[models.Model]) -> None:
    """Insert `objs` (all of one model) as new rows, defaults and auto_now fields applied as
    bulk_create would. A database-generated primary key is not read back (the objects keep
    pk None): for rows, such as audit events, that nothing refers to by id afterwards."""
    if not objs:
        return
    model = type(objs[0])
    if connection.vendor != "postgresql":
        model.objects.bulk_create(objs)
        return
    meta = model._meta
    generated = meta.pk if meta.pk.attname and getattr(objs[0], meta.pk.attname) is None else None
    fields = [field for field in meta.concrete_fields if field is not generated]
    rows = [{field.column: field.pre_save(obj, add=True) for field in fields} for obj in objs]
    table = connection.ops.quote_name(meta.db_table)
    columns = ", ".join(connection.ops.quote_name(field.column) for field in fields)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} ({columns}) SELECT {columns} "
            f"FROM jsonb_populate_recordset(NULL::{table}, %s::jsonb)",
            [json.dumps(rows, default=_plain)],
        )
    for obj in objs:
        obj._state.adding = False
        obj._state.db = connection.alias
