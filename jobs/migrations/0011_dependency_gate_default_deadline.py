"""Gates waiting without a deadline (fan-ins without `within_seconds`, from before every
gate had one) get the default bound, SCHEDULER_DEPENDENCY_WITHIN_SECONDS, counted from
their creation: the deadline loop then decides them like the others."""

from django.conf import settings
from django.db import migrations


def gates_bound(apps, schema_editor):
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "UPDATE jobs_dependency_gate SET deadline_at = created_at + make_interval(secs => %s)"
            " WHERE state = 'waiting' AND deadline_at IS NULL",
            [float(settings.SCHEDULER_DEPENDENCY_WITHIN_SECONDS)],
        )


class Migration(migrations.Migration):
    dependencies = [("jobs", "0010_reconcile_held")]
    operations = [migrations.RunPython(gates_bound, migrations.RunPython.noop)]
