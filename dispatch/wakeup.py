"""A loop's sleep that ends early on a NOTIFY (jobs.notify): a dedicated autocommit
connection LISTENs on the loop's channels. Any failure of that connection only turns the
wait back into a plain sleep until it reconnects, so a listener never stops a loop."""

from __future__ import annotations

import logging
import time

from django.db import connections

from storage.notify import notifications_listen

from .loop import StopSignal

log = logging.getLogger("dispatch.wakeup")
# How often a wait looks at the stop signal: SIGTERM lands between these slices.
STOP_CHECK_SECONDS = 0.25
RECONNECT_SECONDS = 5.0


class Listener:
    def __init__(self, channels: tuple[str, ...], stop: StopSignal) -> None:
        self.channels = channels
        self.stop = stop
        self._connection = None
        self._retry_at = 0.0
        # The payloads of the notifications that ended the latest wait.
        self.payloads: list[str] = []

    def _connect(self):
        wrapper = connections["default"]
        conn = wrapper.get_new_connection(wrapper.get_connection_params())
        conn.autocommit = True
        notifications_listen(connection=conn, channels=self.channels)
        return conn

    def _listening(self):
        if self._connection is None and time.monotonic() >= self._retry_at:
            try:
                self._connection = self._connect()
            except Exception:  # noqa: BLE001 - the database is away: poll until it returns
                log.warning("LISTEN connection failed; polling meanwhile", exc_info=True)
                self._retry_at = time.monotonic() + RECONNECT_SECONDS
        return self._connection

    def wait(self, seconds: float) -> bool:
        """Sleep up to `seconds`; True when a notification (or the stop signal) ended it.
        Notifications that arrived while the loop worked end the next wait at once."""
        deadline = time.monotonic() + seconds
        self.payloads = []
        while not self.stop.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            slice_ = min(remaining, STOP_CHECK_SECONDS)
            conn = self._listening()
            if conn is None:
                self.stop.wait(slice_)
                continue
            try:
                self.payloads = [n.payload for n in conn.notifies(timeout=slice_, stop_after=1)]
                if self.payloads:
                    self._drain(conn)
                    return True
            except Exception:  # noqa: BLE001 - a broken LISTEN connection: reconnect later
                log.warning("LISTEN connection lost; polling meanwhile", exc_info=True)
                self.close()
                self._retry_at = time.monotonic() + RECONNECT_SECONDS
        return True

    def _drain(self, conn) -> None:
        """Consume the notifications already queued: one wake-up for a burst of commits."""
        for notification in conn.notifies(timeout=0.001):  # 0 would mean "no timeout"
            self.payloads.append(notification.payload)

    def close(self) -> None:
        if self._connection is not None:
            try:
                self._connection.close()
            except Exception:  # noqa: BLE001 - being thrown away
                pass
            self._connection = None
