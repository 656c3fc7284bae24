"""Run logs' rows written on the worker's hot path (logs_app.store)."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from typing import NamedTuple

from .sql import execute

MANIFEST_FIELDS = (
    "attempt_id", "chunk_count", "line_count", "byte_count", "sha256", "dropped_lines",
)  # fmt: skip


class LogManifestRow(NamedTuple):
    """One attempt's log manifest; `created_at` None: the transaction's time (NOW())."""

    attempt_id: int
    chunk_count: int
    line_count: int
    byte_count: int
    sha256: str
    dropped_lines: int
    created_at: dt.datetime | None


def log_manifests_insert(*, manifests: Sequence[LogManifestRow]) -> int:
    """Insert the manifests in one statement, the rows as one JSON document (no model
    machinery on the worker's hot path, as storage.rows). Runs in the caller's transaction
    (the one that ends the attempts); locks the new rows, and waits on a concurrent insert
    of the same attempt's manifest (unique). Returns the number of rows inserted."""
    if not manifests:
        return 0
    columns = ", ".join(MANIFEST_FIELDS)
    return execute(
        f"INSERT INTO logs_app_logmanifest ({columns}, created_at)"
        f" SELECT {columns}, COALESCE(created_at, NOW())"
        " FROM jsonb_populate_recordset(NULL::logs_app_logmanifest, %s::jsonb)",
        [manifests_document(manifests)],
    )


def manifests_document(manifests: Sequence[LogManifestRow]) -> str:
    """The manifests as one JSON document, the rows jsonb_populate_recordset reads."""
    return json.dumps([
        {**{field: getattr(m, field) for field in MANIFEST_FIELDS},
         "created_at": m.created_at.isoformat() if m.created_at is not None else None}
        for m in manifests
    ])  # fmt: skip
