"""storage.notify: a notification sent in a transaction reaches a listener at commit only."""

from __future__ import annotations

import pytest
from django.db import connection, transaction

from storage.notify import notification_send, notifications_listen


def _listener(channels: tuple[str, ...]):
    conn = connection.get_new_connection(connection.get_connection_params())
    conn.autocommit = True
    notifications_listen(connection=conn, channels=channels)
    return conn


def _received(conn) -> list[tuple[str, str]]:
    return [(n.channel, n.payload) for n in conn.notifies(timeout=0.5, stop_after=10)]


@pytest.mark.django_db(transaction=True)
def test_a_notification_arrives_at_commit_once_and_not_after_a_rollback():
    listener = _listener(("storage_test_a", "storage_test_b"))
    try:
        with transaction.atomic():
            notification_send(channel="storage_test_a", payload="x")
            notification_send(channel="storage_test_a", payload="x")  # folded into one
            assert _received(listener) == []  # not before the commit
        assert _received(listener) == [("storage_test_a", "x")]

        with pytest.raises(RuntimeError), transaction.atomic():
            notification_send(channel="storage_test_b", payload="dropped")
            raise RuntimeError("roll back")
        notification_send(channel="storage_test_b", payload="")  # autocommit: at once
        assert _received(listener) == [("storage_test_b", "")]
    finally:
        listener.close()
