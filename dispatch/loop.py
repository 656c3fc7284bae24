"""The thin loop around every `*_run_once`: stop on SIGTERM/SIGINT, back off on outages.

A step returns how long to sleep; the loop adds jitter so that replicas drift apart.
Database and broker errors close the connection and back off (up to 5 s), so a process
reconnects by itself after PostgreSQL or RabbitMQ restarts.
"""

from __future__ import annotations

import logging
import random
import signal
import threading
from collections.abc import Callable

from amqp.exceptions import AMQPError
from django.db import DatabaseError, close_old_connections, connections
from kombu.exceptions import KombuError

BROKER_ERRORS: tuple[type[BaseException], ...] = (OSError, KombuError, AMQPError)
MAX_BACKOFF_SECONDS = 5.0


class StopSignal:
    """Set by SIGTERM or SIGINT; the loop finishes its current step, then returns."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def install(self) -> StopSignal:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: self.event.set())
        return self

    def is_set(self) -> bool:
        return self.event.is_set()

    def wait(self, seconds: float) -> None:
        self.event.wait(seconds)


def run_loop(
    step: Callable[[], float],
    *,
    name: str,
    stop: StopSignal,
    max_steps: int | None = None,
    on_error: Callable[[BaseException], None] | None = None,
) -> None:
    log = logging.getLogger(f"dispatch.{name}")
    backoff = 0.1
    steps = 0
    while not stop.is_set() and (max_steps is None or steps < max_steps):
        steps += 1
        try:
            close_old_connections()
            sleep_for = step()
            backoff = 0.1
        except (DatabaseError, *BROKER_ERRORS) as exc:
            log.warning("%s step failed, retrying in %.1fs: %r", name, backoff, exc)
            for connection in connections.all():
                connection.close_if_unusable_or_obsolete()
                if isinstance(exc, DatabaseError):
                    connection.close()
            if on_error is not None:
                on_error(exc)
            sleep_for = backoff
            backoff = min(MAX_BACKOFF_SECONDS, backoff * 2)
        if sleep_for > 0:
            stop.wait(sleep_for * random.uniform(0.9, 1.1))
    log.info("%s stopped", name)
