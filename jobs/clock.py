"""The database's clock: leases, due times and heartbeats are compared with it, so a
process whose own clock is skewed neither steals nor loses work."""

import datetime as dt

from django.db import connection
from django.utils import timezone


def db_now() -> dt.datetime:
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT clock_timestamp()")
            return cursor.fetchone()[0].astimezone(dt.UTC)
    # Embedded defaults: every process shares one machine, so its clock is the clock.
    return timezone.now()
