"""Bounds on the live tails that wait (`GET /api/v1/runs/{id}/logs/?follow=true`): a long
poll holds a web worker for up to its wait, and a sync worker serves nothing else meanwhile,
so unbounded tails starve every other request (`/healthz` included).

A waiting tail takes a slot: one of SCHEDULER_LOG_FOLLOW_MAX_WAITING for the whole host
(every web process of it, whatever its worker class) and one of
SCHEDULER_LOG_FOLLOW_MAX_WAITING_PER_USER of its user. A slot is a file in
SCHEDULER_LOG_FOLLOW_SLOTS_DIR locked with flock(LOCK_EX | LOCK_NB): taken without
waiting, released when the request ends, and by the kernel when its process dies (SIGKILL
included), so no slot leaks. A tail that finds none answers 429 with Retry-After, which
clients of the logs API already handle (the follow throttle answers it too).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from django.conf import settings


def _take(directory: Path, prefix: str, count: int) -> int | None:
    """A locked slot file's descriptor, of `count` named `prefix-<i>`; None: all held."""
    for index in range(count):
        fd = os.open(directory / f"{prefix}-{index}", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return fd
    return None


@contextlib.contextmanager
def tail_slot(*, user_id: int) -> Iterator[bool]:
    """Whether a waiting tail of `user_id` may wait (a slot of the host's and one of the
    user's are held until the block ends), else False: answer without waiting."""
    directory = Path(settings.SCHEDULER_LOG_FOLLOW_SLOTS_DIR)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    held = []
    try:
        for prefix, count in (
            (f"user-{user_id}", settings.SCHEDULER_LOG_FOLLOW_MAX_WAITING_PER_USER),
            ("host", settings.SCHEDULER_LOG_FOLLOW_MAX_WAITING),
        ):
            fd = _take(directory, prefix, count)
            if fd is None:
                yield False
                return
            held.append(fd)
        yield True
    finally:
        for fd in held:
            os.close(fd)  # closing the descriptor releases its lock
