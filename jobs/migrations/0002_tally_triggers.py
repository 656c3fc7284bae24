# The metrics the database keeps in jobs_tally as the events commit (storage.tallies;
# docs/operations.md, "Metrics"): the stage histograms and the attempts by outcome (row
# triggers), the runs by state and the outbox backlog (statement triggers, started from the
# rows already there).

from django.db import migrations

from storage.tallies import STAGE_HISTOGRAMS, STATE_TALLIES


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0001_jobs_runs_attempts"),
    ]

    operations = [
        STAGE_HISTOGRAMS.operation(),
        STATE_TALLIES.operation(),
    ]
