"""A Celery beat schedule as a team moving off beat has one: `schedctl import-beat
celeryconfig_beat:app -w imported.yaml` turns it into a jobs file."""

from datetime import timedelta

from celery import Celery
from celery.schedules import crontab

app = Celery("myteam", set_as_current=False)
app.conf.timezone = "Europe/Berlin"
app.conf.beat_schedule = {
    "morning report": {
        "task": "myteam.report",
        "schedule": crontab(minute=0, hour=9, day_of_week="mon-fri"),
        "args": ["daily sales"],
    },
    "ping": {"task": "myteam.ping", "schedule": timedelta(minutes=1)},
    "legacy export": {"task": "legacy.export", "schedule": 3600.0},  # not a job task: named
}
