"""The throttles' fixed windows: one counter row per (scope, user or address), shared by
every web process (jobs.throttling)."""

from __future__ import annotations

from .sql import fetch_value

# jobs_throttle_window.throttle_key's length: a longer key is cut to it.
KEY_MAX_CHARS = 200


def throttle_hit(*, key: str, window: int) -> int:
    """Count one request under `key` in `window` (its number: the window's start divided
    by its length); the requests counted in that window so far, this one included. A row
    of an older window starts over at 1. One upsert, exact under concurrency: it takes the
    row's lock until the caller's transaction ends (autocommit: at once), so two hits on
    one key queue one behind the other, never lose a count."""
    return fetch_value(
        """INSERT INTO jobs_throttle_window (throttle_key, bucket, hits) VALUES (%s, %s, 1)
           ON CONFLICT (throttle_key) DO UPDATE SET
               hits = CASE WHEN jobs_throttle_window.bucket = excluded.bucket
                           THEN jobs_throttle_window.hits + 1 ELSE 1 END,
               bucket = excluded.bucket
           RETURNING hits""",
        [key[:KEY_MAX_CHARS], window],
    )
