# The metrics the database keeps as the events commit (storage.tallies; docs/operations.md,
# "Metrics"): the triggers append to jobs_tally_delta, which the pruner rolls up into
# jobs_tally; the stage histograms and the attempts by outcome (row triggers), the runs by
# state and the outbox backlog (statement triggers, started from the rows already there).

from django.db import migrations, models

from storage.tallies import STAGE_HISTOGRAMS, STATE_TALLIES


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0001_jobs_runs_attempts"),
    ]

    operations = [
        migrations.CreateModel(
            name="TallyDelta",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("name", models.CharField(max_length=200)),
                ("labels", models.CharField(blank=True, default="", max_length=400)),
                ("count", models.BigIntegerField(default=0)),
                ("total", models.FloatField(default=0.0)),
            ],
            options={"db_table": "jobs_tally_delta"},
        ),
        STAGE_HISTOGRAMS.operation(),
        STATE_TALLIES.operation(),
    ]
