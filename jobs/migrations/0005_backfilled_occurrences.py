# The occurrences of each job that a backfill has run, kept past retention (jobs.models.
# BackfilledOccurrences), started from the backfill runs already there.

import django.db.models.deletion
from django.db import migrations, models

from storage.backfills import BACKFILLED_FROM_RUNS


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0004_throttle_window_ends_at"),
    ]

    operations = [
        migrations.CreateModel(
            name="BackfilledOccurrences",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("first", models.DateTimeField()),
                ("last", models.DateTimeField()),
                ("step", models.DurationField()),
                (
                    "job",
                    models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="+",
                        to="jobs.job",
                    ),
                ),
            ],
            options={
                "indexes": [models.Index(fields=["job", "last"], name="backfilled_job_last_idx")],
                "constraints": [
                    models.CheckConstraint(
                        condition=models.Q(("first__lte", models.F("last"))),
                        name="backfilled_first_not_after_last",
                    )
                ],
            },
        ),
        BACKFILLED_FROM_RUNS.operation(),
    ]
