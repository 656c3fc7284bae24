"""The thin loop around every `*_run_once`: stop on SIGTERM/SIGINT, back off on outages.

A step returns how long to sleep (`run_once_step` makes one of a `*_run_once` and its
config); the loop adds jitter so that replicas drift apart.
A failed step closes the connection and backs off (up to 5 s), so a process reconnects by
itself after PostgreSQL or RabbitMQ restarts, and no single bad step kills it.
"""

from __future__ import annotations

import logging
import random
import signal
import threading
from collections.abc import Callable
from typing import Any

from amqp.exceptions import AMQPError
from django.db import DatabaseError, close_old_connections, connections
from kombu.exceptions import KombuError

from jobs.clock import db_now

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


def run_once_step(
    run_once: Callable[..., Any],
    config: Any,
    *,
    sleep: Callable[[Any], float] | None = None,
    **arguments: Any,
) -> Callable[[], float]:
    """A loop step: `run_once(now=<the database's clock>, config=config, **arguments)`, then
    no sleep while its batch was full, else `sleep(result)` seconds (by default the
    config's poll_interval). A `run_once` that returns None did nothing this step."""

    def step() -> float:
        result = run_once(now=db_now(), config=config, **arguments)
        if getattr(result, "batch_full", False):
            return 0.0
        return config.poll_interval if sleep is None else sleep(result)

    return step


def run_loop(
    step: Callable[[], float],
    *,
    name: str,
    stop: StopSignal,
    max_steps: int | None = None,
    on_error: Callable[[BaseException], None] | None = None,
    wait: Callable[[float], object] | None = None,
) -> None:
    """Loop `step` until `stop`; `wait(seconds)` sleeps between steps (by default a plain
    sleep; a `dispatch.wakeup.Listener`'s wait ends early on a notification)."""
    log = logging.getLogger(f"dispatch.{name}")
    backoff = 0.1
    steps = 0
    while not stop.is_set() and (max_steps is None or steps < max_steps):
        steps += 1
        try:
            close_old_connections()
            sleep_for = step()
            backoff = 0.1
        except Exception as exc:  # noqa: BLE001 - a loop must outlive any one bad step
            expected = isinstance(exc, (DatabaseError, *BROKER_ERRORS))
            # Outages are expected and logged briefly; anything else is a bug, reported with
            # its traceback (and to Sentry through logging), then retried after a back-off.
            log.log(
                logging.WARNING if expected else logging.ERROR,
                "%s step failed, retrying in %.1fs: %r",
                name,
                backoff,
                exc,
                exc_info=not expected,
            )
            for connection in connections.all():
                if isinstance(exc, DatabaseError):
                    connection.close()
                else:
                    connection.close_if_unusable_or_obsolete()
            if on_error is not None:
                on_error(exc)
            sleep_for = backoff
            backoff = min(MAX_BACKOFF_SECONDS, backoff * 2)
        if sleep_for > 0:
            (wait or stop.wait)(sleep_for * random.uniform(0.9, 1.1))
    log.info("%s stopped", name)
