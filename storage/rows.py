"""Many rows of one model in one INSERT, cheaply in Python.

Django's bulk_create on PostgreSQL sends each column as an array (`UNNEST`), and psycopg
writes an array literal of JSON values by escaping every quote of every value with a
regular expression: for 1,000 job specs that cost more than the database's work. Here the
rows go as one JSON document that `jsonb_populate_recordset` unpacks server-side; json
encodes it in C. Any model's rows: the statement is built from the model's own fields.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Sequence

from django.db import connection, models

from .sql import execute


def _plain(value):
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not a column value rows_insert knows")


def rows_insert(
    *, groups: Sequence[Sequence[models.Model]], notify: tuple[str, str] | None = None
) -> None:
    """Insert each group's objects (each group of one model) as new rows, defaults and
    auto_now fields applied as bulk_create would; all groups in one statement (the first
    groups in data-modifying CTEs: one round trip; foreign keys are checked at commit,
    Django's constraints being deferred). A database-generated primary key is not read back
    (the objects keep pk None): for rows, such as versions and audit events, that nothing
    refers to by id afterwards. Runs in the caller's transaction; takes the new rows' locks
    (and a unique index's, which makes a concurrent insert of the same key wait).
    `notify`: a (channel, payload) queued in the same statement, as
    storage.notify.notification_send queues it (delivered when the transaction commits)."""
    groups = tuple(group for group in groups if group)
    if not groups:
        return
    inserts, params = [], []
    for group in groups:
        meta = type(group[0])._meta
        generated = meta.pk if getattr(group[0], meta.pk.attname) is None else None
        fields = [field for field in meta.concrete_fields if field is not generated]
        rows = [{field.column: field.pre_save(obj, add=True) for field in fields} for obj in group]
        table = connection.ops.quote_name(meta.db_table)
        columns = ", ".join(connection.ops.quote_name(field.column) for field in fields)
        inserts.append(
            f"INSERT INTO {table} ({columns}) SELECT {columns} "
            f"FROM jsonb_populate_recordset(NULL::{table}, %s::jsonb)"
        )
        params.append(json.dumps(rows, default=_plain))
    if notify is not None:  # a data-modifying CTE runs whether read or not
        inserts.append("SELECT pg_notify(%s, %s)")
        params.extend(notify)
    ctes = ", ".join(f"r{index} AS ({sql})" for index, sql in enumerate(inserts[:-1]))
    # Prepared: its text is the same for every creation of the same groups' models.
    execute((f"WITH {ctes} " if ctes else "") + inserts[-1], params, prepared=True)
    for group in groups:
        for obj in group:
            obj._state.adding = False
            obj._state.db = connection.alias
