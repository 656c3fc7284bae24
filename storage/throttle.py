"""The throttles' fixed windows: one counter row per (scope, user or address), shared by
every web process (jobs.throttling), its window taken from the database's clock; the
pruner deletes the rows whose window has ended."""

from __future__ import annotations

import datetime as dt
from typing import NamedTuple

from .sql import execute, fetch_one

# jobs_throttle_window.throttle_key's length: a longer key is cut to it.
KEY_MAX_CHARS = 200


class ThrottleHit(NamedTuple):
    hits: int  # counted in the key's current window so far, this one included
    retry_after: float  # seconds until that window ends, on the database's clock
    read_at: dt.datetime  # the database's clock as the statement read it (UTC)


def throttle_hit(*, key: str, window_seconds: int) -> ThrottleHit:
    """Count one request under `key` in the current window of `window_seconds` on the
    database's clock (`clock_timestamp()`; windows start at multiples of their length since
    the epoch), never a web process's own: processes whose clocks differ count in one
    window. A row of an ended window starts over at 1, and so does one whose window ends
    more than a window after this one's (the rate's length changed, or the database's clock
    was set back). A row one window ahead is a concurrent hit's that read the clock later,
    at a window's edge: this hit counts in it, so the window never goes back.

    One upsert, exact under concurrency: it takes the row's lock until the caller's
    transaction ends (autocommit: at once), so two hits on one key queue one behind the
    other, never lose a count."""
    row = fetch_one(
        """WITH clock AS (
               SELECT read_at, to_timestamp(
                          (floor(extract(epoch FROM read_at) / %(length)s) + 1) * %(length)s
                      ) AS ends
               FROM (SELECT clock_timestamp() AS read_at) AS server
           ), hit AS (
               INSERT INTO jobs_throttle_window AS counted (throttle_key, window_ends_at, hits)
               SELECT %(key)s, ends, 1 FROM clock
               ON CONFLICT (throttle_key) DO UPDATE SET
                   hits = CASE WHEN counted.window_ends_at BETWEEN excluded.window_ends_at
                                    AND excluded.window_ends_at + %(length)s * interval '1 s'
                               THEN counted.hits + 1 ELSE 1 END,
                   window_ends_at = CASE
                       WHEN counted.window_ends_at BETWEEN excluded.window_ends_at
                            AND excluded.window_ends_at + %(length)s * interval '1 s'
                       THEN counted.window_ends_at ELSE excluded.window_ends_at END
               RETURNING hits, window_ends_at
           )
           SELECT hits, extract(epoch FROM window_ends_at - read_at)::float8, read_at
           FROM hit, clock""",
        {"key": key[:KEY_MAX_CHARS], "length": window_seconds},
        prepared=True,  # every API request
    )
    return ThrottleHit(hits=row[0], retry_after=row[1], read_at=row[2].astimezone(dt.UTC))


def throttle_windows_delete_ended(*, now: dt.datetime, limit: int) -> int:
    """Delete up to `limit` rows whose window ended at or before `now` (the pruner's, the
    database's clock), the earliest ended first (through throttle_window_ends_idx); how
    many. A key's next hit inserts its row again, counting from 1 as the ended window's row
    would have. Skips the rows a hit holds (SKIP LOCKED); in the caller's transaction."""
    return execute(
        """DELETE FROM jobs_throttle_window
           WHERE window_ends_at <= %(now)s AND throttle_key IN (
               SELECT throttle_key FROM jobs_throttle_window
               WHERE window_ends_at <= %(now)s
               ORDER BY window_ends_at
               LIMIT %(limit)s
               FOR UPDATE SKIP LOCKED
           )""",
        {"now": now, "limit": limit},
    )
