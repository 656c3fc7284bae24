"""Attempts released unstarted (a pack's reserved attempts its worker never reached; see
docs/semantics.md, "Packed deliveries") are not counted as lost in scheduler_attempts_total:
they never ran. Only PostgreSQL reserves attempts."""

from django.db import migrations

# Lost, with no start, and its error ends with jobs.transitions.RELEASED_ERROR.
RELEASED = (
    "NEW.state = 'lost' AND NEW.started_at IS NULL AND right(NEW.error, 13) = '; not started'"
)
TRIGGER = """
DROP TRIGGER attempt_measure_finish ON jobs_attempt;
CREATE TRIGGER attempt_measure_finish AFTER UPDATE OF state ON jobs_attempt FOR EACH ROW
    WHEN (OLD.state = 'running' AND NEW.state NOT IN ('running', 'succeeded'){extra})
    EXECUTE FUNCTION scheduler_attempt_ended();
"""


def released_not_counted(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(TRIGGER.format(extra=f" AND NOT ({RELEASED})"))


def released_counted(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(TRIGGER.format(extra=""))


class Migration(migrations.Migration):
    dependencies = [("jobs", "0012_attempt_reserved")]

    operations = [migrations.RunPython(released_not_counted, released_counted)]
